//! Compiles the worker API from `proto/` with the protoc that the `protoc-bin-vendored` crate ships,
//! so building needs no system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("dispatch_descriptor.bin"))
        .compile_protos(
            &[
                "proto/dispatch/v1/broker.proto",
                "proto/dispatch/v1/admin.proto",
                "proto/externalscaler.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
