//! Expand and modify requests on one volume, arriving close together (external-resizer handles
//! both), merged into one ModifyVolume: EBS accepts one modification per volume every six hours,
//! so two separate calls would fail the second for hours.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

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
type Waiters = Vec<oneshot::Sender<Result<u64>>>;

#[derive(Default)]
struct State {
    /// Modifications still inside their window, merged per volume.
    pending: HashMap<String, (Modification, Waiters)>,
    /// Modifications sent to EC2 and not yet answered.
    in_flight: HashMap<String, (Modification, Waiters)>,
}

struct Shared {
    state: Mutex<State>,
    /// Woken whenever a modification in flight has been answered.
    done: Notify,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Coalescer {
    state: Arc<Shared>,
    window: Duration,
    apply: Apply,
}

impl Modification {
    /// Whether applying `other` also achieves everything `self` asks for.
    fn covered_by(&self, other: &Modification) -> bool {
        fn same<T: PartialEq>(want: &Option<T>, got: &Option<T>) -> bool {
            want.is_none() || want == got
        }
        self.size_gib
            .is_none_or(|s| other.size_gib.is_some_and(|o| o >= s))
            && same(&self.volume_type, &other.volume_type)
            && same(&self.iops, &other.iops)
            && same(&self.throughput, &other.throughput)
    }
}

impl Coalescer {
    pub fn new(window: Duration, apply: Apply) -> Self {
        Coalescer {
            state: Arc::new(Shared {
                state: Mutex::new(State::default()),
                done: Notify::new(),
            }),
            window,
            apply,
        }
    }

    /// Queues `m` for `volume_id`; resolves to the volume's size in GiB once the merged
    /// modification has been accepted. A request already covered by the modification in flight
    /// (a CO retrying after a timeout) waits for that one's answer instead of sending a second
    /// ModifyVolume, which EBS would refuse for six hours.
    pub async fn modify(&self, volume_id: &str, m: Modification) -> Result<u64> {
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut state = self.state.lock();
            match state.in_flight.get_mut(volume_id) {
                Some((sent, waiters)) if m.covered_by(sent) => {
                    waiters.push(tx);
                    false
                }
                _ => {
                    let entry = state.pending.entry(volume_id.to_string()).or_default();
                    entry.0.merge(&m);
                    entry.1.push(tx);
                    entry.1.len() == 1
                }
            }
        };
        if first {
            let (state, apply, window, id) = (
                self.state.clone(),
                self.apply.clone(),
                self.window,
                volume_id.to_string(),
            );
            tokio::spawn(async move {
                tokio::time::sleep(window).await;
                // EBS takes one modification per volume at a time: a newer one waits for the
                // answer to the one in flight, still merging whatever arrives meanwhile.
                let merged = loop {
                    // Created before the check, so an answer arriving in between still wakes it.
                    let finished = state.done.notified();
                    {
                        let mut st = state.lock();
                        if !st.in_flight.contains_key(&id) {
                            let Some(entry) = st.pending.remove(&id) else {
                                return;
                            };
                            let merged = entry.0.clone();
                            st.in_flight.insert(id.clone(), entry);
                            break merged;
                        }
                    }
                    finished.await;
                };
                let result = apply(id.clone(), merged).await;
                let waiters = state
                    .lock()
                    .in_flight
                    .remove(&id)
                    .map(|(_, w)| w)
                    .unwrap_or_default();
                state.done.notify_waiters();
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

    /// A CO retrying while the ModifyVolume is in flight gets that call's answer; a different
    /// modification waits for it and then goes out on its own, never two at once.
    #[tokio::test]
    async fn a_retry_in_flight_joins_and_a_new_modification_waits_its_turn() {
        use tokio::sync::Semaphore;
        use tokio::time::timeout;
        let events = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Semaphore::new(0));
        let (e, g) = (events.clone(), gate.clone());
        let apply: Apply = Arc::new(move |_id, m: Modification| {
            let (e, g) = (e.clone(), g.clone());
            Box::pin(async move {
                e.lock().unwrap().push(format!("start {m:?}"));
                g.acquire().await.expect("gate open").forget();
                e.lock().unwrap().push("end".to_string());
                Ok(m.size_gib.unwrap_or(7))
            })
        });
        let c = Arc::new(Coalescer::new(Duration::from_millis(5), apply));
        let size = |gib| Modification {
            size_gib: Some(gib),
            ..Default::default()
        };
        let first = tokio::spawn({
            let c = c.clone();
            async move { c.modify("vol-1", size(20)).await }
        });
        timeout(Duration::from_secs(10), async {
            while events.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the first modification never went out");
        // Polled once each: the retries join the call in flight, the iops change queues.
        let mut retry = Box::pin(c.modify("vol-1", size(20)));
        let mut smaller = Box::pin(c.modify("vol-1", size(10)));
        let iops = Modification {
            iops: Some(3000),
            ..Default::default()
        };
        let mut other = Box::pin(c.modify("vol-1", iops.clone()));
        for f in [&mut retry, &mut smaller, &mut other] {
            assert!(timeout(Duration::ZERO, f).await.is_err(), "answered early");
        }
        // Its window passes while the first is in flight: it must not start.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let started = events.lock().unwrap().clone();
        assert_eq!(started.len(), 1, "{started:?}");
        gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), 20);
        assert_eq!(retry.await.unwrap(), 20);
        assert_eq!(smaller.await.unwrap(), 20);
        assert_eq!(other.await.unwrap(), 7);
        assert_eq!(
            *events.lock().unwrap(),
            vec![
                format!("start {:?}", size(20)),
                "end".to_string(),
                format!("start {iops:?}"),
                "end".to_string(),
            ]
        );
    }
}
