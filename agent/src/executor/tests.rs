//! The executor against a fake runner: each operation the executor starts tells the test, and
//! ends when the test says how it ended, so ordering, the one operation per path, the slots,
//! backoff timers and their cancellation are checked without a plugin or a handler.

use super::*;
use crate::event_source::SourceKind;
use crate::notifications::NotificationBus;
use crate::state::actual::ActualState;
use crate::state::backoff::FailureKind;
use crate::state::desired::DesiredState;
use crate::state::queue::Work;
use std::path::PathBuf;
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot};

/// An operation the executor started: its path, its kind, and how the test ends it.
struct Running {
    path: PathBuf,
    kind: OperationKind,
    end: oneshot::Sender<Ended>,
}

/// Tells the test of every operation, and waits for the test to end it.
struct FakeRunner {
    started: mpsc::UnboundedSender<Running>,
    /// Operations running now, and the most at once.
    running: Mutex<(usize, usize)>,
}

impl FakeRunner {
    fn operation(self: Arc<Self>, path: PathBuf, kind: OperationKind) -> Operation<Ended> {
        Box::pin(async move {
            {
                let mut running = self.running.lock().expect("running");
                running.0 += 1;
                running.1 = running.1.max(running.0);
            }
            let (end, ended) = oneshot::channel();
            let told = self.started.send(Running { path, kind, end });
            let ended = match told {
                Ok(()) => ended.await.unwrap_or(Ended::Done),
                Err(_) => Ended::Done,
            };
            self.running.lock().expect("running").0 -= 1;
            ended
        })
    }
}

impl OperationRunner for FakeRunner {
    fn register(self: Arc<Self>, registration: Registration) -> Operation<Ended> {
        // A socket named `waiting*` does not listen yet: its dial pauses (an hour, unless the
        // kernel reports its listen) before the operation goes on.
        let waits = registration
            .path
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with("waiting"));
        let operation = self.operation(registration.path, OperationKind::Register);
        // The slot is held for as long as the operation runs.
        let mut slot = registration.slot;
        Box::pin(async move {
            if waits {
                crate::registration::Pause::pause(&mut slot, Duration::from_secs(3600)).await;
            }
            let ended = operation.await;
            drop(slot);
            ended
        })
    }

    fn deregister(
        self: Arc<Self>,
        path: PathBuf,
        _registered: RegisteredPlugin,
        slot: Slot,
        _requested: Instant,
    ) -> Operation<()> {
        let operation = self.operation(path, OperationKind::Deregister);
        Box::pin(async move {
            operation.await;
            drop(slot);
        })
    }
}

struct Harness {
    executor: Arc<OperationExecutor>,
    liveness: Arc<Liveness>,
    runner: Arc<FakeRunner>,
    started: mpsc::UnboundedReceiver<Running>,
    desired: Arc<DesiredState>,
    actual: Arc<ActualState>,
    backoff: Arc<BackoffTable>,
    queue: Arc<ReconcileQueue>,
    cancel: CancellationToken,
}

impl Harness {
    /// An executor of `slots` slots over a fake runner.
    fn new(slots: usize) -> Self {
        let (tx, started) = mpsc::unbounded_channel();
        let runner = Arc::new(FakeRunner {
            started: tx,
            running: Mutex::default(),
        });
        let (actual, backoff, queue) = (Arc::default(), Arc::default(), Arc::default());
        let telemetry = Telemetry::new(SourceKind::Ebpf);
        let unserved = Unserved::new(
            Arc::clone(&actual),
            Arc::clone(&backoff),
            Arc::clone(&queue),
            NotificationBus::default(),
            telemetry.clone(),
        );
        let liveness = Arc::new(Liveness::default());
        let parts = ExecutorParts {
            backoff: Arc::clone(&backoff),
            queue: Arc::clone(&queue),
            liveness: liveness.clone(),
            unserved,
            handlers: Arc::default(),
            telemetry,
        };
        let config = ExecutorConfig {
            max_concurrent: slots,
            listens_reported: true,
            ..ExecutorConfig::default()
        };
        let cancel = CancellationToken::new();
        let executor = OperationExecutor::new(runner.clone(), parts, &config, cancel.clone());
        Harness {
            executor,
            liveness,
            runner,
            started,
            desired: Arc::default(),
            actual,
            backoff,
            queue,
            cancel,
        }
    }

    /// The desired entry of a socket found at `name` (by a walk unless `by_event`).
    fn desired(&self, name: &str, by_event: bool) -> DesiredPlugin {
        let path = path(name);
        let socket = crate::state::SocketId {
            dev: 1,
            ino: name.len() as u64 + 100 * u64::from(name.as_bytes()[0]),
            birth_ns: None,
            handle: None,
        };
        self.desired
            .add_observed(&path, socket, None, by_event, None)
            .expect("desired");
        self.desired.get(&path).expect("desired")
    }

    /// A registration of `name` to deregister.
    fn registered(&self, name: &str) -> RegisteredPlugin {
        let desired = self.desired(name, true);
        let plugin = crate::handler::Plugin {
            plugin_type: "CSIPlugin".into(),
            name: name.into(),
            endpoint: String::new(),
            supported_versions: Vec::new(),
            socket_path: path(name).display().to_string(),
        };
        self.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin,
            Arc::new(crate::handler::accept_all::AcceptAll),
            crate::provenance::Provenance::default(),
        )
    }

    async fn next(&mut self) -> Running {
        tokio::time::timeout(Duration::from_secs(60), self.started.recv())
            .await
            .expect("an operation started")
            .expect("the executor is alive")
    }

    /// Whether `name` is among the paths marked since the last look.
    fn marked(&self, name: &str) -> bool {
        match self.queue.take() {
            Some(Work::Paths(paths)) => paths.contains(&path(name)),
            Some(Work::Everything) => true,
            None => false,
        }
    }
}

fn path(name: &str) -> PathBuf {
    PathBuf::from(format!("/plugins/{name}.sock"))
}

/// Lets every task that can run, run (the paused clock does not move).
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn one_operation_per_path_and_the_path_is_looked_at_again_when_it_ends() {
    let mut h = Harness::new(4);
    let desired = h.desired("a", true);
    assert_eq!(
        h.executor.register(&path("a"), desired.clone()),
        Start::Started
    );
    let running = h.next().await;
    assert_eq!(
        (running.path.clone(), running.kind),
        (path("a"), OperationKind::Register)
    );
    assert!(h.executor.is_running(&path("a")));
    assert_eq!(
        h.executor.register(&path("a"), desired.clone()),
        Start::AlreadyRunning(OperationKind::Register),
        "a second registration of the path"
    );
    let registered = h.registered("a");
    assert_eq!(
        h.executor.deregister(&path("a"), registered),
        Start::AlreadyRunning(OperationKind::Register),
        "a deregistration while the registration runs"
    );
    // Another path runs beside it.
    let other = h.desired("b", true);
    assert_eq!(h.executor.register(&path("b"), other), Start::Started);
    assert_eq!(h.next().await.path, path("b"));
    assert!(!h.marked("a"), "marked before its operation ended");
    running.end.send(Ended::Done).expect("running");
    tokio::time::timeout(Duration::from_secs(60), async {
        while h.executor.is_running(&path("a")) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the claim was released");
    assert!(h.marked("a"), "the path was not looked at again");
    assert_eq!(h.executor.register(&path("a"), desired), Start::Started);
    assert_eq!(h.next().await.path, path("a"));
}

/// One slot: operations run one after the other, in the order they were asked for, and a
/// deregistration (prompt lane) waits for the slot too.
#[tokio::test]
async fn operations_beyond_the_slots_wait_and_run_in_order() {
    let mut h = Harness::new(1);
    for name in ["a", "b", "c"] {
        let desired = h.desired(name, true);
        assert_eq!(h.executor.register(&path(name), desired), Start::Started);
    }
    let registered = h.registered("d");
    assert_eq!(
        h.executor.deregister(&path("d"), registered),
        Start::Started
    );
    let mut order = Vec::new();
    for _ in 0..4 {
        let running = h.next().await;
        settle().await;
        assert!(h.started.try_recv().is_err(), "two operations in one slot");
        order.push((running.path.clone(), running.kind));
        running.end.send(Ended::Done).expect("running");
    }
    assert_eq!(
        order,
        [
            (path("a"), OperationKind::Register),
            (path("b"), OperationKind::Register),
            (path("c"), OperationKind::Register),
            (path("d"), OperationKind::Deregister),
        ]
    );
    assert_eq!(
        h.runner.running.lock().expect("running").1,
        1,
        "most at once"
    );
}

/// A failed attempt's backoff (recorded by the runner) is honoured: no operation before it
/// ends, the path is looked at again when it does, and forgetting the socket cancels that.
#[tokio::test(start_paused = true)]
async fn a_backoff_is_honoured_and_its_timer_cancelled_when_the_socket_goes() {
    let mut h = Harness::new(2);
    for name in ["a", "b"] {
        let desired = h.desired(name, true);
        assert_eq!(
            h.executor.register(&path(name), desired.clone()),
            Start::Started
        );
        let running = h.next().await;
        // What the runner does with a failure: the backoff first, then its end.
        let backoff = h.backoff.fail(
            &path(name),
            desired.socket,
            "refused".into(),
            FailureKind::Other,
            Instant::now(),
        );
        running
            .end
            .send(Ended::RetryAt(backoff.retry_at))
            .expect("running");
        settle().await;
        assert!(matches!(
            h.executor.register(&path(name), desired),
            Start::BackingOff { until } if until == backoff.retry_at
        ));
    }
    h.queue.take();
    h.executor.forget(&path("b"));
    let until = h
        .backoff
        .get(&path("a"), h.desired.get(&path("a")).expect("a").socket);
    let until = until.expect("a backs off").retry_at;
    tokio::time::sleep_until(until + Duration::from_millis(1)).await;
    settle().await;
    match h.queue.take() {
        Some(Work::Paths(paths)) => assert_eq!(
            paths.into_iter().collect::<Vec<_>>(),
            [path("a")],
            "only the socket still there is looked at again"
        ),
        other => panic!("the backoff's end marked {other:?}"),
    }
    let desired = h.desired.get(&path("a")).expect("a");
    assert_eq!(h.executor.register(&path("a"), desired), Start::Started);
    assert_eq!(h.next().await.path, path("a"));
}

/// A held socket (unserved, refused) is not retried by time: an earlier timer is cancelled.
#[tokio::test(start_paused = true)]
async fn a_held_socket_has_no_timer() {
    let mut h = Harness::new(1);
    let desired = h.desired("a", true);
    h.executor.register(&path("a"), desired.clone());
    let running = h.next().await;
    let retry_at = Instant::now() + Duration::from_secs(1);
    running.end.send(Ended::RetryAt(retry_at)).expect("running");
    settle().await;
    assert_eq!(h.executor.waits.pending(), 1);
    h.executor.register(&path("a"), desired);
    let running = h.next().await;
    running.end.send(Ended::Held).expect("running");
    settle().await;
    assert_eq!(
        h.executor.waits.pending(),
        0,
        "the held socket's timer runs on"
    );
    h.queue.take();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!h.marked("a"), "a held socket was looked at again by time");
}

/// Shutdown starts nothing: a registration still waiting for its slot never runs, and the
/// drain waits for the one that runs.
#[tokio::test]
async fn shutdown_starts_no_waiting_operation_and_drain_waits_for_running_ones() {
    let mut h = Harness::new(1);
    for name in ["a", "b"] {
        let desired = h.desired(name, true);
        assert_eq!(h.executor.register(&path(name), desired), Start::Started);
    }
    let running = h.next().await;
    h.cancel.cancel();
    let executor = h.executor.clone();
    let drained = tokio::spawn(async move { executor.drain().await });
    settle().await;
    assert!(!drained.is_finished(), "drained while an operation runs");
    running.end.send(Ended::Done).expect("running");
    drained.await.expect("drain");
    assert!(
        h.started.try_recv().is_err(),
        "an operation started after shutdown"
    );
}

/// A `listen` the kernel reports (liveness's hint) ends the pause of the registration that
/// holds the path, and only that one.
#[tokio::test]
async fn a_listen_the_kernel_reports_ends_the_pause_of_the_registration_of_its_path() {
    let mut h = Harness::new(2);
    for name in ["waiting-a", "waiting-b"] {
        let desired = h.desired(name, true);
        assert_eq!(h.executor.register(&path(name), desired), Start::Started);
    }
    settle().await;
    h.liveness.kernel_hint(&path("elsewhere"), true);
    h.liveness.kernel_hint(&path("waiting-b"), true);
    let running = h.next().await;
    assert_eq!(
        running.path,
        path("waiting-b"),
        "the listen woke another operation"
    );
    settle().await;
    assert!(
        h.started.try_recv().is_err(),
        "a pause ended without its listen"
    );
    running.end.send(Ended::Done).expect("running");
}
