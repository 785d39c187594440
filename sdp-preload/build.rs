// execl, execlp and execle are C-variadic, which stable Rust cannot define: their bodies are a
// few lines of C (src/execl.c); src/exec.rs exports the symbols as jumps to them. dprintf and
// its kin (src/stdio.c) and syscall (src/syscall.c) are C for the same reason.
fn main() {
    println!("cargo:rerun-if-changed=src/execl.c");
    println!("cargo:rerun-if-changed=src/stdio.c");
    println!("cargo:rerun-if-changed=src/syscall.c");
    cc::Build::new()
        .file("src/execl.c")
        .file("src/stdio.c")
        .file("src/syscall.c")
        .warnings_into_errors(true)
        .compile("sdp_execl");
}
