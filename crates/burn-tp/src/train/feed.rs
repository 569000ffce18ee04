//! How a replica's batches reach its tp ranks: its leader reads them and hands each to its tp
//! peers ([`Feed`]), cloned through channels (ranks as threads) or its tensors broadcast over
//! the tp group (ranks as processes, [`ProcessBatch`]).

use std::sync::Mutex;
use std::sync::mpsc::Receiver;

use burn::tensor::{DType, TensorData};
use burn_tp_comm::ProcessGroup;
use burn_train::LearnerModel;

use super::shared::{Codec, Handoff, Inbox, Message, Outbox, Shared};
use crate::{Result, TpError};

/// How this rank gets its replica's batches: the leader reads them and hands each to its tp
/// peers (cloned into their channels with threads, its tensors broadcast over the tp group with
/// processes).
pub(super) struct Feed<'a, M: LearnerModel> {
    pub(super) shared: &'a Shared<M>,
    pub(super) tp_group: ProcessGroup,
    pub(super) leader: bool,
    /// This rank reports its items to the Learner.
    pub(super) reports: bool,
    pub(super) inbox: Inbox<M>,
    pub(super) outbox: Outbox<M>,
}

impl<M: LearnerModel> Feed<'_, M> {
    /// The leader's `next` batch (`None`: the split ended), handed to its tp peers; on a peer,
    /// the leader's. `wrap` / `unwrap` put a batch in a thread message and take it out.
    pub(super) fn hand<T>(
        &self,
        next: Option<T>,
        codec: &Codec<T>,
        wrap: fn(T) -> Message<M>,
        unwrap: fn(Message<M>) -> Option<T>,
    ) -> Result<Option<T>> {
        match codec {
            Codec::Clone(clone) if self.leader => {
                for peer in &self.outbox {
                    let message = next.as_ref().map_or(Handoff::End, |b| wrap(clone(b)));
                    peer.send(message).map_err(|_| peer_gone())?;
                }
                Ok(next)
            }
            Codec::Clone(_) => match self.inbox.as_ref().map(Receiver::recv) {
                Some(Ok(message)) => Ok(unwrap(message)),
                Some(Err(_)) | None => Err(peer_gone()),
            },
            Codec::Data { .. } if self.tp_group.world_size() == 1 => Ok(next),
            Codec::Data { to, from } => {
                let words = match (&next, self.leader) {
                    (Some(batch), true) => Some(encode_batch(&to(batch))?),
                    _ => None,
                };
                let len = words.as_ref().map_or(-1, |w| w.len() as i64);
                let len = self.tp_group.broadcast(vec![len], 0)?[0];
                let Ok(len) = usize::try_from(len) else {
                    return Ok(None);
                };
                let words = words.unwrap_or_else(|| vec![0; len]);
                let words = self.tp_group.broadcast(words, 0)?;
                match self.leader {
                    true => Ok(next),
                    false => Ok(Some(from(decode_batch(&words)?, &self.shared.device))),
                }
            }
        }
    }
}

/// A batch's tensors as words to broadcast: a JSON header (each tensor's dtype, shape and
/// byte length), then the bytes, padded to 8.
fn encode_batch(data: &[TensorData]) -> Result<Vec<i64>> {
    let header: Vec<(DType, Vec<usize>, usize)> = data
        .iter()
        .map(|d| (d.dtype(), d.shape().to_vec(), d.as_bytes().len()))
        .collect();
    let header = serde_json::to_vec(&header)
        .map_err(|e| TpError::Config(format!("train: a batch's header: {e}")))?;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    for d in data {
        bytes.resize(bytes.len().next_multiple_of(8), 0);
        bytes.extend_from_slice(d.as_bytes());
    }
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    Ok(bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// [`encode_batch`]'s tensors back.
fn decode_batch(words: &[i64]) -> Result<Vec<TensorData>> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let bad =
        |what: &str| TpError::Config(format!("train: a broadcast batch is malformed: {what}"));
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or_else(|| bad("no header"))?;
    let header = bytes
        .get(8..8 + header_len)
        .ok_or_else(|| bad("short header"))?;
    let header: Vec<(DType, Vec<usize>, usize)> =
        serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
    let mut at = 8 + header_len;
    let mut out = Vec::with_capacity(header.len());
    for (dtype, shape, len) in header {
        at = at.next_multiple_of(8);
        let chunk = bytes.get(at..at + len).ok_or_else(|| bad("short data"))?;
        out.push(TensorData::from_bytes_vec(chunk.to_vec(), shape, dtype));
        at += len;
    }
    Ok(out)
}

/// What `slots[rank]` holds, taken (none with processes: no slots).
pub(super) fn take_slot<T>(slots: &[Mutex<Option<T>>], rank: usize) -> Option<Option<T>> {
    slots
        .get(rank)
        .map(|s| s.lock().ok().and_then(|mut s| s.take()))
}

fn peer_gone() -> TpError {
    TpError::Config("train: a rank of this replica has stopped (see its error)".into())
}
