//! The seam between scheduling and the operations: what the executor hands an operation it lets
//! run, and what the operation tells it back. The executor decides *when* (claims, slots, timers);
//! the runner (the `operations` room, kubelet's operation generator) decides *what* an operation
//! does and what its outcome means for the socket's backoff, which it records before it ends.

use super::slots::Slot;
use crate::state::actual::RegisteredPlugin;
use crate::state::desired::DesiredPlugin;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use tokio::time::Instant;

/// An operation's future, boxed once: the executor spawns it, and a registration that waits for
/// its socket to listen holds it all along, so its size is the wait's cost.
pub type Operation<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The steps of the operations the executor schedules.
pub trait OperationRunner: Send + Sync + 'static {
    /// Registers `registration.desired`, in `registration.slot`; ends with what the executor must
    /// do about the path next (the socket's backoff is recorded by then).
    fn register(self: Arc<Self>, registration: Registration) -> Operation<Ended>;

    /// Deregisters `registered` from `path` (asked for at `requested`), holding `slot`.
    fn deregister(
        self: Arc<Self>,
        path: PathBuf,
        registered: RegisteredPlugin,
        slot: Slot,
        requested: Instant,
    ) -> Operation<()>;
}

/// A registration the executor lets run.
pub struct Registration {
    /// The socket path.
    pub path: PathBuf,
    /// Its desired-state entry when the registration was asked for.
    pub desired: DesiredPlugin,
    /// Its slot: given back in the dial's long pauses (see `slots`).
    pub slot: Slot,
    /// 1 for a first attempt, then one more per failure of this socket instance.
    pub attempt: u32,
    /// When it was asked for: waiting for the slot counts in its time.
    pub queued: Instant,
    /// The connection a look made when it found the socket listening, for the first dial.
    pub found: Option<tokio::net::UnixStream>,
}

/// What a registration leaves the executor to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Registered (or observed), or abandoned at shutdown: nothing to wait for.
    Done,
    /// Held until its socket changes (unserved, refused by the policy): no retry, and an
    /// earlier timer of the path is cancelled.
    Held,
    /// Looked at again at this instant (a backoff's end, or the end of a wait for kubelet).
    RetryAt(Instant),
    /// The socket refuses connections (bound, not listening yet) and may listen until `until`:
    /// it waits without an operation for the kernel's report of its listen or its next look.
    WaitToListen {
        /// When the wait ends and the socket counts as unserved.
        until: Instant,
        /// What the last attempt found, for `list`.
        reason: String,
    },
}
