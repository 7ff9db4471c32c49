//! `courier job ...` and `courier status`.

#[derive(clap::Args)]
pub struct ClientOpts {}

#[derive(clap::Subcommand)]
pub enum JobCmd {}

pub async fn job(_o: ClientOpts, _c: JobCmd) -> anyhow::Result<()> {
    anyhow::bail!("not wired yet")
}
pub async fn status(_o: ClientOpts) -> anyhow::Result<()> {
    anyhow::bail!("not wired yet")
}
