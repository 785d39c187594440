// execl, execlp and execle are C-variadic, which stable Rust cannot define: their bodies are a
// few lines of C (src/execl.c); src/exec.rs exports the symbols as jumps to them.
fn main() {
    println!("cargo:rerun-if-changed=src/execl.c");
    cc::Build::new()
        .file("src/execl.c")
        .warnings_into_errors(true)
        .compile("sdp_execl");
}
