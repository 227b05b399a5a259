//! Expand and modify requests on one volume, arriving close together (external-resizer handles
//! both), merged into one ModifyVolume: EBS accepts one modification per volume every six hours,
//! so two separate calls would fail the second for hours.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modification {
    pub size_gib: Option<u64>,
    pub volume_type: Option<String>,
    pub iops: Option<u64>,
    pub throughput: Option<u64>,
}

impl Modification {
    fn merge(&mut self, other: &Modification) {
        self.size_gib = self.size_gib.max(other.size_gib);
        if other.volume_type.is_some() {
            self.volume_type.clone_from(&other.volume_type);
        }
        if other.iops.is_some() {
            self.iops = other.iops;
        }
        if other.throughput.is_some() {
            self.throughput = other.throughput;
        }
    }
}

type Apply = Arc<
    dyn Fn(String, Modification) -> Pin<Box<dyn Future<Output = Result<u64>> + Send>> + Send + Sync,
>;
type Pending = HashMap<String, (Modification, Vec<oneshot::Sender<Result<u64>>>)>;

pub struct Coalescer {
    pending: Arc<Mutex<Pending>>,
    window: Duration,
    apply: Apply,
}

impl Coalescer {
    pub fn new(window: Duration, apply: Apply) -> Self {
        Coalescer {
            pending: Arc::new(Mutex::new(HashMap::new())),
            window,
            apply,
        }
    }

    /// Queues `m` for `volume_id`; resolves to the volume's size in GiB once the merged
    /// modification has been accepted.
    pub async fn modify(&self, volume_id: &str, m: Modification) -> Result<u64> {
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let entry = pending.entry(volume_id.to_string()).or_default();
            entry.0.merge(&m);
            entry.1.push(tx);
            entry.1.len() == 1
        };
        if first {
            let (pending, apply, window, id) = (
                self.pending.clone(),
                self.apply.clone(),
                self.window,
                volume_id.to_string(),
            );
            tokio::spawn(async move {
                tokio::time::sleep(window).await;
                let Some((merged, waiters)) = pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id)
                else {
                    return;
                };
                let result = apply(id, merged).await;
                for w in waiters {
                    let _ = w.send(match &result {
                        Ok(v) => Ok(*v),
                        Err(e) => Err(e.duplicate()),
                    });
                }
            });
        }
        rx.await
            .map_err(|_| Error::Internal("a coalesced modification was dropped".into()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn expand_and_modify_become_one_call() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let apply: Apply = Arc::new(move |id, m: Modification| {
            s.lock().unwrap().push((id, m.clone()));
            Box::pin(async move { Ok(m.size_gib.unwrap_or(1)) })
        });
        let c = Arc::new(Coalescer::new(Duration::from_millis(30), apply));
        let (a, b) = tokio::join!(
            c.modify(
                "vol-1",
                Modification {
                    size_gib: Some(20),
                    ..Default::default()
                }
            ),
            c.modify(
                "vol-1",
                Modification {
                    volume_type: Some("io2".into()),
                    iops: Some(4000),
                    ..Default::default()
                }
            )
        );
        assert_eq!((a.unwrap(), b.unwrap()), (20, 20));
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(
            seen[0].1,
            Modification {
                size_gib: Some(20),
                volume_type: Some("io2".into()),
                iops: Some(4000),
                throughput: None
            }
        );
    }
}
