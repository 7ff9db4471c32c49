//! `courier dev`, `courier broker`, `courier gateway`.

use anyhow::bail;

#[derive(clap::Args)]
pub struct DevArgs {}
#[derive(clap::Args)]
pub struct BrokerArgs {}
#[derive(clap::Args)]
pub struct GatewayArgs {}

pub async fn dev(_a: DevArgs) -> anyhow::Result<()> {
    bail!("not wired yet")
}
pub async fn broker(_a: BrokerArgs) -> anyhow::Result<()> {
    bail!("not wired yet")
}
pub async fn gateway(_a: GatewayArgs) -> anyhow::Result<()> {
    bail!("not wired yet")
}
