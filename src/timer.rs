//! Timeouts of a second or more on a coarse clock: hyper's header-read timeout and the
//! upstream response and read timeouts are armed and dropped on every request, and almost
//! never fire. On tokio's wheel one such timer costs ~700 instructions (a boxed entry, the
//! driver lock, insertion and removal, an occasional driver unpark); here it costs two
//! uncontended shard locks and no clock read: a sweeper thread keeps a millisecond clock
//! ([`now_ms`]) and wakes expired sleeps every [`TICK`].
//!
//! That clock is read from the real one at each tick, so it is never ahead of it: a coarse
//! sleep until an instant fires up to one tick late, never early. A sleep for a duration
//! starts from the coarse clock plus one tick (it may lag by that much), so it too is never
//! early, and fires up to two ticks late. Shorter timeouts stay on tokio's timer, where a
//! tick would be a large error.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use pin_project_lite::pin_project;

/// How often expired sleeps are woken and the coarse clock moves.
pub const TICK: Duration = Duration::from_millis(100);
const TICK_MS: u64 = 100;
/// Timeouts at least this long use the coarse clock.
pub const COARSE_FROM: Duration = Duration::from_secs(1);
const COARSE_FROM_MS: u64 = 1_000;
const SHARDS: usize = 64;

struct Entry {
    /// On the coarse clock: milliseconds since the wheel's epoch.
    deadline: u64,
    waker: Waker,
    woken: bool,
}

/// Armed sleeps of the threads that share one shard: a slab with a free list; and the
/// [`Deadline`]s registered there, dropped from the list once their owner is gone.
#[derive(Default)]
struct Shard {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    deadlines: Vec<Weak<DeadlineInner>>,
}

impl Shard {
    fn insert(&mut self, entry: Entry) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(entry);
                i
            }
            None => {
                self.slots.push(Some(entry));
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        }
    }

    /// Gives back what a spike of sleeps and deadlines left behind: free slots at the end
    /// of the slab, and capacity no longer needed (a spike of 10k connections left ~0.5 MB).
    fn shrink(&mut self) {
        let len = self.slots.len();
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        if self.slots.len() < len {
            let len = self.slots.len();
            self.free.retain(|&i| (i as usize) < len);
        }
        fn fit<T>(v: &mut Vec<T>) {
            if v.capacity() > 64 && v.len() < v.capacity() / 4 {
                v.shrink_to(v.len() * 2);
            }
        }
        fit(&mut self.slots);
        fit(&mut self.free);
        fit(&mut self.deadlines);
    }

    fn remove(&mut self, i: u32) {
        if let Some(slot) = self.slots.get_mut(i as usize) {
            if slot.take().is_some() {
                self.free.push(i);
            }
        }
    }
}

struct Wheel {
    shards: Box<[Mutex<Shard>]>,
    /// The instant the coarse clock counts from.
    epoch: Instant,
    /// The coarse clock: milliseconds since `epoch` at the last tick (rounded down).
    now_ms: AtomicU64,
}

impl Wheel {
    /// `at` on the coarse clock, rounded up (a deadline is never moved earlier).
    fn ms_ceil(&self, at: Instant) -> u64 {
        let d = at.saturating_duration_since(self.epoch);
        d.as_secs().saturating_mul(1_000).saturating_add(u64::from(d.subsec_nanos().div_ceil(1_000_000)))
    }

    /// `at` on the coarse clock, rounded down (the clock is never ahead of the real one).
    fn ms_floor(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }
}

fn lock(shard: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wheel() -> &'static Wheel {
    static WHEEL: OnceLock<Wheel> = OnceLock::new();
    WHEEL.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("tollgate-timer".into()).spawn(|| loop {
            std::thread::sleep(TICK);
            sweep(wheel(), Instant::now());
        });
        if let Err(e) = spawned {
            // Sleeps then complete only when their task is polled for another reason.
            tracing::error!(error = %e, "could not start the timer thread; long timeouts are not enforced");
        }
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Wheel { shards, epoch: Instant::now(), now_ms: AtomicU64::new(0) }
    })
}

/// The coarse clock: milliseconds since the wheel's epoch, as of the last tick. Never ahead
/// of the real clock, at most a tick behind it (more only if the timer thread is starved).
pub fn now_ms() -> u64 {
    wheel().now_ms.load(Ordering::Acquire)
}

/// Moves the coarse clock to `now`, then wakes every sleep whose deadline it passed (once:
/// its task polls it to completion, and sees the clock already moved).
fn sweep(wheel: &Wheel, now: Instant) {
    let now = wheel.ms_floor(now);
    wheel.now_ms.fetch_max(now, Ordering::Release);
    for shard in wheel.shards.iter() {
        let mut shard = lock(shard);
        for entry in shard.slots.iter_mut().flatten() {
            if !entry.woken && entry.deadline <= now {
                entry.woken = true;
                entry.waker.wake_by_ref();
            }
        }
        shard.deadlines.retain(|d| match d.upgrade() {
            Some(d) => {
                // Woken at every tick until its owner moves or clears it: owners act on
                // an expiry at once (they close their connection).
                if d.at.load(Ordering::Acquire) <= now {
                    if let Some(w) = &lock_state(&d.state).waker {
                        w.wake_by_ref();
                    }
                }
                true
            }
            None => false,
        });
        shard.shrink();
    }
}

/// This thread's shard: threads are spread over the shards in the order they first sleep.
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    INDEX.with(|i| *i)
}

/// A sleep until a deadline on the coarse clock.
pub struct CoarseSleep {
    /// Milliseconds since the wheel's epoch.
    deadline: u64,
    /// (shard, slot) once armed; u32s keep a sleep at 24 bytes.
    armed: Option<(u32, u32)>,
}

impl CoarseSleep {
    #[cfg(test)]
    pub fn until(deadline: Instant) -> CoarseSleep {
        CoarseSleep { deadline: wheel().ms_ceil(deadline), armed: None }
    }

    /// `duration` from now, read off the coarse clock without a system call: one tick is
    /// added for what the coarse clock may lag.
    pub fn after(duration: Duration) -> CoarseSleep {
        CoarseSleep { deadline: after_ms(duration), armed: None }
    }

    fn disarm(&mut self) {
        if let Some((shard, slot)) = self.armed.take() {
            lock(&wheel().shards[shard as usize]).remove(slot);
        }
    }

    fn reset_ms(&mut self, deadline: u64) {
        self.disarm();
        self.deadline = deadline;
    }
}

/// The coarse deadline `duration` from now (see [`CoarseSleep::after`]).
fn after_ms(duration: Duration) -> u64 {
    let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    now_ms().saturating_add(ms).saturating_add(TICK_MS + 1)
}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if now_ms() >= self.deadline {
            self.disarm();
            return Poll::Ready(());
        }
        match self.armed {
            None => {
                let shard = shard_index();
                let entry = Entry { deadline: self.deadline, waker: cx.waker().clone(), woken: false };
                let slot = lock(&wheel().shards[shard]).insert(entry);
                // `shard` < SHARDS (64): the cast is lossless.
                self.armed = Some((shard as u32, slot));
            }
            Some((shard, slot)) => {
                let mut shard = lock(&wheel().shards[shard as usize]);
                if let Some(Some(entry)) = shard.slots.get_mut(slot as usize) {
                    if !entry.waker.will_wake(cx.waker()) {
                        entry.waker = cx.waker().clone();
                    }
                }
            }
        }
        Poll::Pending
    }
}

impl Drop for CoarseSleep {
    fn drop(&mut self) {
        self.disarm();
    }
}

/// A sleep on the coarse clock or, when short, on tokio's.
pub enum Sleep {
    Coarse(CoarseSleep),
    Fine(Pin<Box<tokio::time::Sleep>>),
}

impl Sleep {
    /// A sleep for `duration`; a long one reads no clock.
    pub fn after(duration: Duration) -> Sleep {
        if duration >= COARSE_FROM {
            Sleep::Coarse(CoarseSleep::after(duration))
        } else {
            Sleep::Fine(Box::pin(tokio::time::sleep(duration)))
        }
    }

    /// A sleep until `deadline`; whether it is long is judged on the coarse clock.
    pub fn until(deadline: Instant) -> Sleep {
        match coarse_deadline(deadline) {
            Some(ms) => Sleep::Coarse(CoarseSleep { deadline: ms, armed: None }),
            None => Sleep::Fine(Box::pin(tokio::time::sleep_until(deadline.into()))),
        }
    }

    /// Moves the deadline to `duration` from now, keeping the clock it runs on when that
    /// still fits.
    pub fn reset_after(&mut self, duration: Duration) {
        match self {
            Sleep::Coarse(c) if duration >= COARSE_FROM => c.reset_ms(after_ms(duration)),
            other => *other = Sleep::after(duration),
        }
    }
}

/// `deadline` on the coarse clock, when it is at least [`COARSE_FROM`] away on that clock.
fn coarse_deadline(deadline: Instant) -> Option<u64> {
    let wheel = wheel();
    let ms = wheel.ms_ceil(deadline);
    (ms.saturating_sub(wheel.now_ms.load(Ordering::Acquire)) >= COARSE_FROM_MS).then_some(ms)
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.get_mut() {
            Sleep::Coarse(s) => Pin::new(s).poll(cx),
            Sleep::Fine(s) => s.as_mut().poll(cx),
        }
    }
}

/// A deadline that a long-lived owner (a connection) re-arms for wait after wait: registered
/// with the timer thread once, then moved with an atomic store, so a wait costs neither a
/// clock read nor a timer entry. A deadline less than [`COARSE_FROM`] away is waited for on
/// tokio's timer instead, so short timeouts keep their precision. Clones share the deadline.
#[derive(Clone)]
pub struct Deadline {
    inner: Arc<DeadlineInner>,
}

struct DeadlineInner {
    /// On the coarse clock; [`UNARMED`] when no wait is armed.
    at: AtomicU64,
    /// The data and vtable pointers of the waker in `state`: a poll by the task already
    /// registered (the usual case: a connection is polled by its one task) takes no lock.
    registered: [AtomicUsize; 2],
    state: Mutex<DeadlineState>,
}

#[derive(Default)]
struct DeadlineState {
    waker: Option<Waker>,
    /// A fine sleep for a deadline close at hand, with the deadline it was made for.
    fine: Option<(u64, Pin<Box<tokio::time::Sleep>>)>,
}

const UNARMED: u64 = u64::MAX;

fn lock_state(state: &Mutex<DeadlineState>) -> std::sync::MutexGuard<'_, DeadlineState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Default for Deadline {
    fn default() -> Self {
        Deadline::new()
    }
}

impl Deadline {
    /// An unarmed deadline, registered with this thread's shard.
    pub fn new() -> Deadline {
        let inner = Arc::new(DeadlineInner {
            at: AtomicU64::new(UNARMED),
            registered: [AtomicUsize::new(0), AtomicUsize::new(0)],
            state: Mutex::default(),
        });
        lock(&wheel().shards[shard_index()]).deadlines.push(Arc::downgrade(&inner));
        Deadline { inner }
    }

    /// Arms it for `duration` from now, read off the coarse clock (never early).
    pub fn arm_after(&self, duration: Duration) {
        self.inner.at.store(after_ms(duration), Ordering::Release);
    }

    /// Arms it for `duration` from now: off the coarse clock when that is long, else off the
    /// real clock, so that a short timeout keeps its precision.
    pub fn arm_for(&self, duration: Duration) {
        if duration >= COARSE_FROM {
            self.arm_after(duration);
        } else {
            self.arm_at(Instant::now() + duration);
        }
    }

    /// Arms it for `at`.
    pub fn arm_at(&self, at: Instant) {
        self.inner.at.store(wheel().ms_ceil(at), Ordering::Release);
    }

    pub fn disarm(&self) {
        self.inner.at.store(UNARMED, Ordering::Release);
    }

    /// Ready once the armed deadline has passed; otherwise the task is woken when it does.
    /// Unarmed, it never is.
    pub fn poll_expired(&self, cx: &mut Context<'_>) -> Poll<()> {
        let at = self.inner.at.load(Ordering::Acquire);
        let now = now_ms();
        if at <= now {
            return Poll::Ready(());
        }
        let near = at != UNARMED && at - now < COARSE_FROM_MS;
        let task = [cx.waker().data() as usize, std::ptr::from_ref(cx.waker().vtable()) as usize];
        let registered = &self.inner.registered;
        if !near
            && task[0] != 0
            && registered[0].load(Ordering::Acquire) == task[0]
            && registered[1].load(Ordering::Acquire) == task[1]
        {
            return Poll::Pending;
        }
        let mut state = lock_state(&self.inner.state);
        if near {
            let fine = match &mut state.fine {
                Some((made_for, sleep)) if *made_for == at => sleep,
                other => {
                    let when = wheel().epoch + Duration::from_millis(at);
                    &mut other.insert((at, Box::pin(tokio::time::sleep_until(when.into())))).1
                }
            };
            if fine.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        match &state.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => {
                state.waker = Some(cx.waker().clone());
                registered[0].store(task[0], Ordering::Release);
                registered[1].store(task[1], Ordering::Release);
            }
        }
        Poll::Pending
    }
}

/// The coarse clock's reading as an instant: never after the real now, at most a tick
/// before it. For code that must hand an `Instant` to others (hyper's timer).
pub fn coarse_now() -> Instant {
    let wheel = wheel();
    wheel.epoch + Duration::from_millis(wheel.now_ms.load(Ordering::Acquire))
}

pin_project! {
    /// `inner`, or `Err(Elapsed)` once `duration` has passed.
    pub struct Timeout<F> {
        #[pin]
        inner: F,
        sleep: Sleep,
    }
}

/// The timeout has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

pub fn timeout<F: Future>(duration: Duration, inner: F) -> Timeout<F> {
    Timeout { inner, sleep: Sleep::after(duration) }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.inner.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        Pin::new(this.sleep).poll(cx).map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_coarse_timeout_fires_after_its_deadline_and_not_before() {
        let started = Instant::now();
        let out = timeout(Duration::from_millis(1200), std::future::pending::<()>()).await;
        assert_eq!(out, Err(Elapsed));
        assert!(started.elapsed() >= Duration::from_millis(1200), "fired early: {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn a_finished_or_dropped_sleep_leaves_nothing_armed() {
        assert_eq!(timeout(Duration::from_secs(30), async { 7 }).await, Ok(7));
        // A deadline no other test uses, to tell this sleep's slot from a reuse of it.
        let mut sleep = Box::pin(CoarseSleep::until(Instant::now() + Duration::from_secs(3_600 + 4_321)));
        let deadline = sleep.deadline;
        let is_armed = |(shard, slot): (u32, u32)| {
            // The sweeper may have dropped a free slot at the end already.
            lock(&wheel().shards[shard as usize])
                .slots
                .get(slot as usize)
                .is_some_and(|e| e.as_ref().is_some_and(|e| e.deadline == deadline))
        };
        assert!(futures_util::poll!(sleep.as_mut()).is_pending());
        let at = sleep.armed.expect("a pending sleep is armed");
        assert!(is_armed(at));
        drop(sleep);
        assert!(!is_armed(at), "dropping it disarms it");
    }

    fn test_wheel(shards: usize) -> Wheel {
        let shards = (0..shards).map(|_| Mutex::new(Shard::default())).collect();
        Wheel { shards, epoch: Instant::now(), now_ms: AtomicU64::new(0) }
    }

    #[test]
    fn the_sweep_moves_the_clock_and_wakes_only_what_expired() {
        let waker = futures_util::task::noop_waker();
        let wheel = test_wheel(2);
        let soon = lock(&wheel.shards[0]).insert(Entry { deadline: 500, waker: waker.clone(), woken: false });
        let later = lock(&wheel.shards[1]).insert(Entry { deadline: 9_000, waker, woken: false });
        sweep(&wheel, wheel.epoch + Duration::from_millis(1_000));
        assert_eq!(wheel.now_ms.load(Ordering::Relaxed), 1_000);
        let woken = |s: usize, i: u32| lock(&wheel.shards[s]).slots[i as usize].as_ref().is_some_and(|e| e.woken);
        assert!(woken(0, soon));
        assert!(!woken(1, later));
        // A late sweep with an older reading never moves the clock back.
        sweep(&wheel, wheel.epoch + Duration::from_millis(900));
        assert_eq!(wheel.now_ms.load(Ordering::Relaxed), 1_000);
        lock(&wheel.shards[0]).remove(soon);
        let again = Entry { deadline: 1, waker: futures_util::task::noop_waker(), woken: false };
        assert_eq!(lock(&wheel.shards[0]).insert(again), soon, "slots are reused");
    }

    #[test]
    fn coarse_deadlines_round_so_that_nothing_fires_early() {
        let wheel = test_wheel(1);
        let at = |ms: u64, ns: u32| wheel.epoch + Duration::from_millis(ms) + Duration::from_nanos(u64::from(ns));
        assert_eq!(wheel.ms_ceil(at(5, 0)), 5);
        assert_eq!(wheel.ms_ceil(at(5, 1)), 6, "a deadline rounds up");
        assert_eq!(wheel.ms_floor(at(5, 999_999)), 5, "the clock rounds down");
        // A duration from the coarse clock adds the most it can lag.
        let before = now_ms();
        let deadline = after_ms(Duration::from_secs(2));
        assert!(deadline >= before + 2_000 + TICK_MS, "{deadline} vs {before}");
    }

    #[tokio::test]
    async fn a_deadline_fires_when_armed_never_early_and_can_be_moved() {
        let d = Deadline::new();
        // Unarmed: never.
        assert!(futures_util::poll!(std::future::poll_fn(|cx| d.poll_expired(cx))).is_pending());
        // A short deadline runs on tokio's timer: precise.
        let started = Instant::now();
        d.arm_at(started + Duration::from_millis(150));
        std::future::poll_fn(|cx| d.poll_expired(cx)).await;
        assert!(started.elapsed() >= Duration::from_millis(150), "fired early: {:?}", started.elapsed());
        // Moved far away, it no longer fires; disarmed, neither.
        d.arm_after(Duration::from_secs(60));
        assert!(futures_util::poll!(std::future::poll_fn(|cx| d.poll_expired(cx))).is_pending());
        d.disarm();
        assert!(futures_util::poll!(std::future::poll_fn(|cx| d.poll_expired(cx))).is_pending());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_deadline_is_woken_by_the_timer_thread() {
        let d = Deadline::new();
        let started = Instant::now();
        d.arm_after(Duration::from_millis(1_100));
        tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(|cx| d.poll_expired(cx)))
            .await
            .expect("woken within 10 s");
        assert!(started.elapsed() >= Duration::from_millis(1_100), "fired early: {:?}", started.elapsed());
    }

    #[test]
    fn a_sweep_gives_back_what_a_spike_of_sleeps_left() {
        let wheel = test_wheel(1);
        let mut shard = lock(&wheel.shards[0]);
        let entry = || Entry { deadline: u64::MAX, waker: futures_util::task::noop_waker(), woken: false };
        let slots: Vec<u32> = (0..10_000).map(|_| shard.insert(entry())).collect();
        let kept = slots[3];
        for &i in slots.iter().filter(|&&i| i != kept) {
            shard.remove(i);
        }
        drop(shard);
        sweep(&wheel, wheel.epoch + Duration::from_millis(1_000));
        let mut shard = lock(&wheel.shards[0]);
        assert_eq!(shard.slots.len(), 4, "free slots after the last armed one are dropped");
        assert!(shard.slots.capacity() < 100 && shard.free.capacity() < 100, "and their room given back");
        assert!(shard.slots[kept as usize].is_some());
        assert!(shard.insert(entry()) < 3, "a free slot below the last armed one is reused");
    }

    #[test]
    fn a_dropped_deadline_leaves_its_shard() {
        let d = Deadline::new();
        let weak = Arc::downgrade(&d.inner);
        drop(d);
        assert!(weak.upgrade().is_none());
        sweep(wheel(), Instant::now());
        let left =
            wheel().shards.iter().map(|s| lock(s).deadlines.iter().filter(|w| w.ptr_eq(&weak)).count()).sum::<usize>();
        assert_eq!(left, 0);
    }
}
