//! Coalescing of concurrent lookups by id into shared Describe calls.
//!
//! Under load, hundreds of publish, unpublish and wait loops each want "the current state of
//! volume X". Each request joins the open batch; the batch is sent when its window closes or it
//! is full, with a `volume-id` (or `instance-id`) *filter* — a filter, unlike an id list, does
//! not fail the whole call when one id is unknown — and every waiter gets its own answer.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

type Fetch<V> = Arc<
    dyn Fn(Vec<String>) -> Pin<Box<dyn Future<Output = Result<HashMap<String, V>>> + Send>>
        + Send
        + Sync,
>;
type Waiter<V> = (String, oneshot::Sender<Result<Option<V>>>);

pub struct Batcher<V> {
    pending: Arc<Mutex<Vec<Waiter<V>>>>,
    fetch: Fetch<V>,
    window: Duration,
    max: usize,
    enabled: bool,
}

impl<V: Clone + Send + 'static> Batcher<V> {
    pub fn new(enabled: bool, window: Duration, max: usize, fetch: Fetch<V>) -> Self {
        Batcher {
            pending: Arc::new(Mutex::new(Vec::new())),
            fetch,
            window,
            max,
            enabled,
        }
    }

    /// The object with this id, `None` when it does not exist.
    pub async fn get(&self, id: &str) -> Result<Option<V>> {
        if !self.enabled {
            return Ok((self.fetch)(vec![id.to_string()]).await?.remove(id));
        }
        let (tx, rx) = oneshot::channel();
        let flush_now = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.push((id.to_string(), tx));
            if pending.len() == 1 {
                // First in: open the window.
                let (pending, fetch, window) =
                    (self.pending.clone(), self.fetch.clone(), self.window);
                tokio::spawn(async move {
                    tokio::time::sleep(window).await;
                    let batch =
                        std::mem::take(&mut *pending.lock().unwrap_or_else(|e| e.into_inner()));
                    send(batch, fetch).await;
                });
                None
            } else if pending.len() >= self.max {
                Some(std::mem::take(&mut *pending))
            } else {
                None
            }
        };
        if let Some(batch) = flush_now {
            tokio::spawn(send(batch, self.fetch.clone()));
        }
        rx.await
            .map_err(|_| Error::Internal("a batched lookup was dropped".into()))?
    }
}

async fn send<V: Clone>(batch: Vec<Waiter<V>>, fetch: Fetch<V>) {
    if batch.is_empty() {
        return;
    }
    let mut ids: Vec<String> = batch.iter().map(|(id, _)| id.clone()).collect();
    ids.sort();
    ids.dedup();
    match fetch(ids).await {
        Ok(found) => {
            for (id, tx) in batch {
                let _ = tx.send(Ok(found.get(&id).cloned()));
            }
        }
        Err(e) => {
            for (_, tx) in batch {
                let _ = tx.send(Err(e.duplicate()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_lookups_share_one_call() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let fetch: Fetch<String> = Arc::new(move |ids: Vec<String>| {
            c.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                Ok(ids
                    .into_iter()
                    .filter(|i| i != "missing")
                    .map(|i| (i.clone(), format!("v-{i}")))
                    .collect())
            })
        });
        let b = Arc::new(Batcher::new(true, Duration::from_millis(20), 500, fetch));
        let mut tasks = Vec::new();
        for i in 0..50 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move { b.get(&format!("id{i}")).await }));
        }
        let missing = b.get("missing").await.unwrap();
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap().unwrap(), Some(format!("v-id{i}")));
        }
        assert_eq!(missing, None);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "51 lookups, one call");
    }

    #[tokio::test]
    async fn a_full_batch_is_sent_at_once() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let fetch: Fetch<u32> = Arc::new(move |ids: Vec<String>| {
            c.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Ok(ids.into_iter().map(|i| (i, 1)).collect()) })
        });
        let b = Arc::new(Batcher::new(true, Duration::from_secs(3600), 2, fetch));
        let (x, y) = tokio::join!(b.get("a"), b.get("b"));
        assert_eq!((x.unwrap(), y.unwrap()), (Some(1), Some(1)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
