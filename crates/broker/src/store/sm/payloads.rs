//! Payloads stored apart from their job's record (see the engine's `payload`
//! module): a keyspace of encoded [`Payload`]s by job key, and the record of such a
//! job, which holds none and ends with the payload's size.

use super::super::{read_err, write_err};
use crate::engine::{Job, Payload};
use courier_proto::codec;
use courier_proto::domain::{JobKey, NodeId};
use fjall::Keyspace;
use openraft::StorageError;

/// The stored form of a job: its encoding, followed, when its payload is stored
/// apart, by that payload's size.
pub fn record(job: &Job, stored: Option<u64>) -> Result<Vec<u8>, StorageError<NodeId>> {
    let mut bytes = codec::to_vec(job).map_err(write_err)?;
    if let Some(size) = stored {
        bytes.extend(codec::to_vec(&size).map_err(write_err)?);
    }
    Ok(bytes)
}

/// A job's record read back: the job, and its payload's size when stored apart.
pub fn read_record(bytes: &[u8]) -> Result<(Job, Option<u64>), StorageError<NodeId>> {
    let (job, rest): (Job, _) = codec::decode_prefix(bytes).map_err(read_err)?;
    if rest.is_empty() {
        return Ok((job, None));
    }
    Ok((job, Some(codec::decode(rest).map_err(read_err)?)))
}

pub fn key_bytes(key: JobKey) -> [u8; 8] {
    (key.0 as u64).to_be_bytes()
}

/// The payloads of one partition, shared with its leader-side tasks.
#[derive(Clone)]
pub struct PayloadStore {
    ks: Keyspace,
}

impl PayloadStore {
    pub fn new(ks: Keyspace) -> PayloadStore {
        PayloadStore { ks }
    }

    pub fn keyspace(&self) -> &Keyspace {
        &self.ks
    }

    /// Job `key`'s stored payload, if it has one.
    pub fn get(&self, key: JobKey) -> Result<Option<Payload>, StorageError<NodeId>> {
        match self.ks.get(key_bytes(key)).map_err(read_err)? {
            Some(v) => Ok(Some(codec::decode(&v).map_err(read_err)?)),
            None => Ok(None),
        }
    }
}

/// Writes into `put` the encoding of every job of `view` whole: a record whose
/// payload is stored apart is joined with it.
pub fn whole_jobs(
    view: &fjall::Snapshot,
    jobs: &Keyspace,
    payloads: &Keyspace,
    mut put: impl FnMut(&[u8]) -> Result<(), StorageError<NodeId>>,
) -> Result<(), StorageError<NodeId>> {
    use fjall::Readable;
    // Without a payload stored apart every record is whole as it is.
    let any_apart = view.iter(payloads).next().is_some();
    for g in view.iter(jobs) {
        let (k, v) = g.into_inner().map_err(read_err)?;
        if !any_apart {
            put(&v)?;
            continue;
        }
        let (mut job, apart) = read_record(&v)?;
        if apart.is_none() {
            put(&v)?;
            continue;
        }
        // Written in the same batch as the record, so always there.
        let payload: Payload = match view.get(payloads, &k).map_err(read_err)? {
            Some(p) => codec::decode(&p).map_err(read_err)?,
            None => {
                return Err(read_err(std::io::Error::other(format!(
                    "job {} has no stored payload",
                    job.key
                ))))
            }
        };
        job.variables = payload.variables;
        job.custom_headers = payload.custom_headers;
        put(&codec::to_vec(&job).map_err(write_err)?)?;
    }
    Ok(())
}
