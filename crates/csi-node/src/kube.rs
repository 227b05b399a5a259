//! Just enough of the Kubernetes API for the node plugin, from inside its pod: read its Node
//! (identity fallback), see whether kubelet lists the driver in its CSINode, and remove the
//! startup taint. A few HTTPS calls with the pod's service account; a full client (kube-rs)
//! would outweigh the rest of the plugin.

use cloud_backend::{Error, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::path::Path;
use std::sync::Arc;

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

pub struct Client {
    host: String,
    port: u16,
    token: String,
    tls: tokio_rustls::TlsConnector,
}

impl Client {
    /// The in-cluster configuration: KUBERNETES_SERVICE_HOST/PORT and the service account's
    /// token and CA bundle.
    pub fn in_cluster() -> Result<Client> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
            Error::Unavailable("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset)".into())
        })?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(443);
        let dir = Path::new(SA_DIR);
        let token = std::fs::read_to_string(dir.join("token"))
            .map_err(|e| Error::io("reading the service account token", e))?
            .trim()
            .to_string();
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        use rustls_pki_types::pem::PemObject;
        let certs = rustls_pki_types::CertificateDer::pem_file_iter(dir.join("ca.crt"))
            .map_err(|e| Error::Unavailable(format!("reading the cluster CA: {e}")))?;
        for cert in certs {
            let cert =
                cert.map_err(|e| Error::Unavailable(format!("parsing the cluster CA: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::Unavailable(format!("adding the cluster CA: {e}")))?;
        }
        let config = tokio_rustls::rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Client {
            host,
            port,
            token,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> Result<(u16, serde_json::Value)> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| Error::Unavailable(format!("connecting to the API server: {e}")))?;
        let name = rustls_pki_types::ServerName::try_from(self.host.clone())
            .map_err(|e| Error::Unavailable(format!("API server name: {e}")))?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| Error::Unavailable(format!("TLS to the API server: {e}")))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| Error::Unavailable(format!("HTTP to the API server: {e}")))?;
        tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host)
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json");
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Error::Internal(format!("building a request: {e}")))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| Error::Unavailable(format!("{method} {path}: {e}")))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| Error::Unavailable(format!("{method} {path}: {e}")))?
            .to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Ok((status, value))
    }

    pub async fn get(&self, path: &str) -> Result<serde_json::Value> {
        match self.request("GET", path, None, vec![]).await? {
            (200, v) => Ok(v),
            (404, _) => Err(Error::NotFound(format!("{path} does not exist"))),
            (code, v) => Err(Error::Unavailable(format!(
                "GET {path}: HTTP {code}: {}",
                v["message"].as_str().unwrap_or("")
            ))),
        }
    }

    pub async fn json_patch(&self, path: &str, patch: &serde_json::Value) -> Result<()> {
        let body = serde_json::to_vec(patch).map_err(|e| Error::Internal(e.to_string()))?;
        match self
            .request("PATCH", path, Some("application/json-patch+json"), body)
            .await?
        {
            (200, _) => Ok(()),
            (code, v) => Err(Error::Unavailable(format!(
                "PATCH {path}: HTTP {code}: {}",
                v["message"].as_str().unwrap_or("")
            ))),
        }
    }
}

/// Removes the taint `key` from `node` once kubelet lists `driver` in the node's CSINode, so
/// pods needing a volume are not scheduled before the plugin can serve them. Runs until done.
pub async fn remove_startup_taint(node: String, driver: String, key: String) {
    let mut delay = std::time::Duration::from_secs(1);
    loop {
        match try_remove_taint(&node, &driver, &key).await {
            Ok(true) => {
                tracing::info!(%node, taint = %key, "removed the startup taint: the driver is registered");
                return;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(%node, taint = %key, error = %e, "could not remove the startup taint yet")
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(std::time::Duration::from_secs(30));
    }
}

async fn try_remove_taint(node: &str, driver: &str, key: &str) -> Result<bool> {
    let client = Client::in_cluster()?;
    let csinode = match client
        .get(&format!("/apis/storage.k8s.io/v1/csinodes/{node}"))
        .await
    {
        Ok(v) => v,
        Err(Error::NotFound(_)) => return Ok(false),
        Err(e) => return Err(e),
    };
    let registered = csinode["spec"]["drivers"]
        .as_array()
        .is_some_and(|d| d.iter().any(|x| x["name"] == driver));
    if !registered {
        return Ok(false);
    }
    let n = client.get(&format!("/api/v1/nodes/{node}")).await?;
    let Some(index) = n["spec"]["taints"]
        .as_array()
        .and_then(|t| t.iter().position(|x| x["key"] == key))
    else {
        return Ok(true); // already gone
    };
    // `test` makes the removal fail, rather than remove the wrong entry, if the list changed.
    let patch = serde_json::json!([
        {"op": "test", "path": format!("/spec/taints/{index}/key"), "value": key},
        {"op": "remove", "path": format!("/spec/taints/{index}")}
    ]);
    client
        .json_patch(&format!("/api/v1/nodes/{node}"), &patch)
        .await?;
    Ok(true)
}

/// The instance's identity from its Node object (`spec.providerID` is
/// `aws:///<zone>/<instance-id>`; labels carry the zone and instance type): the fallback when
/// instance metadata is unreachable from the pod.
pub async fn aws_identity_from_node(node: &str) -> Result<(String, String, String)> {
    let n = Client::in_cluster()?
        .get(&format!("/api/v1/nodes/{node}"))
        .await?;
    let provider = n["spec"]["providerID"].as_str().unwrap_or_default();
    let mut parts = provider
        .trim_start_matches("aws://")
        .trim_start_matches('/')
        .split('/');
    let zone_from_id = parts.next().unwrap_or_default().to_string();
    let instance = parts.next().unwrap_or_default().to_string();
    let labels = &n["metadata"]["labels"];
    let zone = labels["topology.kubernetes.io/zone"]
        .as_str()
        .map(str::to_string)
        .unwrap_or(zone_from_id);
    let instance_type = labels["node.kubernetes.io/instance-type"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if instance.is_empty() || zone.is_empty() {
        return Err(Error::NotFound(format!(
            "node {node} has no aws providerID (got {provider:?})"
        )));
    }
    Ok((instance, zone, instance_type))
}
