//! Generates the gRPC code from `proto/` with a vendored `protoc`, so a fresh
//! machine needs no system install.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    config.bytes([".courier.cluster"]);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = ["gateway.proto", "courier.proto", "cluster.proto"].map(|f| root.join(f));
    tonic_prost_build::configure()
        .codec_path("crate::wire::Codec")
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &files, std::slice::from_ref(&root))?;
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    Ok(())
}
