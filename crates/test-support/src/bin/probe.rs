//! `ferrovol-probe <socket> [--wait SECONDS]`: the smallest CSI client, for checks from outside
//! a container (`cargo xtask images --test`). It connects to the plugin's Unix socket, retrying
//! until the socket answers or `--wait` (default 30) seconds pass, prints GetPluginInfo's name
//! and version, and calls Probe. It exits non-zero unless Probe says `ready: true`.

use anyhow::{Context, Result, bail};
use std::time::{Duration, Instant};
use test_support::v1::identity_client::IdentityClient;
use test_support::v1::{GetPluginInfoRequest, ProbeRequest};

const USAGE: &str = "usage: ferrovol-probe <socket path or unix:// endpoint> [--wait SECONDS]";
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (endpoint, wait) = match args.as_slice() {
        [endpoint] => (endpoint, 30),
        [endpoint, flag, secs] if flag == "--wait" => (
            endpoint,
            secs.parse()
                .with_context(|| format!("--wait {secs}: not a number\n{USAGE}"))?,
        ),
        _ => bail!("{USAGE}"),
    };
    let deadline = Instant::now() + Duration::from_secs(wait);
    let channel = loop {
        match csi_identity::server::connect(endpoint).await {
            Ok(channel) => break channel,
            Err(err) if Instant::now() >= deadline => {
                return Err(err).with_context(|| {
                    format!("{endpoint} did not accept a connection within {wait} s")
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let mut identity = IdentityClient::new(channel);

    let info = tokio::time::timeout(
        RPC_TIMEOUT,
        identity.get_plugin_info(GetPluginInfoRequest {}),
    )
    .await
    .context("GetPluginInfo timed out")?
    .context("GetPluginInfo failed")?
    .into_inner();
    println!("plugin: {} {}", info.name, info.vendor_version);
    if info.name.is_empty() {
        bail!("GetPluginInfo returned an empty name");
    }

    let probe = tokio::time::timeout(RPC_TIMEOUT, identity.probe(ProbeRequest {}))
        .await
        .context("Probe timed out")?
        .context("Probe failed")?
        .into_inner();
    match probe.ready {
        Some(true) => {
            println!("probe: ready");
            Ok(())
        }
        Some(false) => bail!("Probe answered ready=false"),
        None => bail!("Probe answered without `ready`"),
    }
}
