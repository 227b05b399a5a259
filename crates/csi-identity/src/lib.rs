//! The CSI Identity service, and the plumbing both plugin binaries share.
//!
//! - [`IdentityService`]: GetPluginInfo, GetPluginCapabilities, Probe.
//! - [`status`]: the one place where domain errors become gRPC status codes.
//! - [`server`]: serving on a Unix socket with gRPC health and clean shutdown on signals.
//! - [`logging`]: tracing-subscriber set-up (text or JSON).
//! - [`task`]: running a mutating RPC to completion even when its caller gives up.

pub mod logging;
pub mod metrics;
pub mod server;
pub mod status;
pub mod task;

use csi_proto::v1::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse, identity_server,
    plugin_capability,
};
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Readiness as Probe reports it. Must be cheap and local: livenessprobe calls it every few
/// seconds and restarts the container when it fails.
pub type Readiness = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Clone)]
pub struct IdentityService {
    name: String,
    version: String,
    manifest: HashMap<String, String>,
    capabilities: Vec<PluginCapability>,
    ready: Readiness,
}

/// The plugin-wide capabilities of a ferrovol driver. Both binaries advertise the same set:
/// they describe the driver as a whole (the node binary's driver also has a controller).
pub fn plugin_capabilities(topology: bool) -> Vec<PluginCapability> {
    use plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
    let service = |t: service::Type| PluginCapability {
        r#type: Some(Type::Service(Service { r#type: t as i32 })),
    };
    let mut caps = vec![
        service(service::Type::ControllerService),
        PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: volume_expansion::Type::Online as i32,
            })),
        },
    ];
    if topology {
        caps.push(service(service::Type::VolumeAccessibilityConstraints));
    }
    caps
}

impl IdentityService {
    pub fn new(
        name: impl Into<String>,
        manifest: HashMap<String, String>,
        capabilities: Vec<PluginCapability>,
        ready: Readiness,
    ) -> Self {
        IdentityService {
            name: name.into(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            manifest,
            capabilities,
            ready,
        }
    }
}

#[tonic::async_trait]
impl identity_server::Identity for IdentityService {
    /// MUST return the driver name (a DNS-style name, at most 63 characters, the same across
    /// every instance of the driver) and its version.
    #[tracing::instrument(skip_all)]
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: self.version.clone(),
            manifest: self.manifest.clone(),
        }))
    }

    /// MUST list what the plugin as a whole supports; the answer never changes while the
    /// plugin runs.
    #[tracing::instrument(skip_all)]
    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: self.capabilities.clone(),
        }))
    }

    /// Reports whether the plugin is healthy and ready. Kept local and cheap on purpose: a
    /// slow or failing dependency must not make livenessprobe restart the plugin in a loop.
    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse {
            ready: Some((self.ready)()),
        }))
    }
}

pub mod validate;
