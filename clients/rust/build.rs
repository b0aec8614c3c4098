//! Compiles the client side of the worker API from the repository's `proto/` with the protoc
//! that the `protoc-bin-vendored` crate ships, so building needs no system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["../../proto/dispatch/v1/broker.proto"], &["../../proto"])?;
    println!("cargo:rerun-if-changed=../../proto/dispatch/v1/broker.proto");
    Ok(())
}
