//! LD_PRELOAD shim (next wave).
