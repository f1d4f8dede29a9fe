//! Timeouts of a second or more on a coarse clock: hyper's header-read timeout and the
//! upstream response timeout are armed and dropped on every request, and almost never fire.
//! On tokio's wheel one such timer costs ~700 instructions (a boxed entry, the driver lock,
//! insertion and removal, an occasional driver unpark); here it costs two uncontended shard
//! locks. A sweeper thread wakes expired sleeps every [`TICK`], so a coarse timeout fires up
//! to one tick late, never early: every poll compares against the real clock first.
//! Shorter timeouts stay on tokio's timer, where a tick would be a large error.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use pin_project_lite::pin_project;

/// How often expired sleeps are woken.
pub const TICK: Duration = Duration::from_millis(100);
/// Timeouts at least this long use the coarse clock.
pub const COARSE_FROM: Duration = Duration::from_secs(1);
const SHARDS: usize = 64;

struct Entry {
    deadline: Instant,
    waker: Waker,
    woken: bool,
}

/// Armed sleeps of the threads that share one shard: a slab with a free list.
#[derive(Default)]
struct Shard {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
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
        Wheel { shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect() }
    })
}

/// Wakes every sleep whose deadline passed (once: its task polls it to completion).
fn sweep(wheel: &Wheel, now: Instant) {
    for shard in wheel.shards.iter() {
        let mut shard = lock(shard);
        for entry in shard.slots.iter_mut().flatten() {
            if !entry.woken && entry.deadline <= now {
                entry.woken = true;
                entry.waker.wake_by_ref();
            }
        }
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

/// A sleep until `deadline` on the coarse clock.
pub struct CoarseSleep {
    deadline: Instant,
    /// (shard, slot) once armed; u32s keep a sleep at 32 bytes.
    armed: Option<(u32, u32)>,
}

impl CoarseSleep {
    pub fn until(deadline: Instant) -> CoarseSleep {
        CoarseSleep { deadline, armed: None }
    }

    fn disarm(&mut self) {
        if let Some((shard, slot)) = self.armed.take() {
            lock(&wheel().shards[shard as usize]).remove(slot);
        }
    }

    pub fn reset(&mut self, deadline: Instant) {
        self.disarm();
        self.deadline = deadline;
    }
}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
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
    /// A sleep until `deadline`, which is `duration` from now.
    fn at(deadline: Instant, duration: Duration) -> Sleep {
        if duration >= COARSE_FROM {
            Sleep::Coarse(CoarseSleep::until(deadline))
        } else {
            Sleep::Fine(Box::pin(tokio::time::sleep_until(deadline.into())))
        }
    }

    pub fn after(duration: Duration) -> Sleep {
        Sleep::at(Instant::now() + duration, duration)
    }

    pub fn until(deadline: Instant) -> Sleep {
        Sleep::at(deadline, deadline.saturating_duration_since(Instant::now()))
    }

    /// Moves the deadline, keeping the clock it runs on when that still fits.
    pub fn reset(&mut self, deadline: Instant) {
        let duration = deadline.saturating_duration_since(Instant::now());
        match self {
            Sleep::Coarse(c) if duration >= COARSE_FROM => c.reset(deadline),
            Sleep::Fine(s) if duration < COARSE_FROM => s.as_mut().reset(deadline.into()),
            other => *other = Sleep::at(deadline, duration),
        }
    }
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

/// hyper's timer: coarse sleeps for the long timeouts it arms per request.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoarseTimer;

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Sleep::after(duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Sleep::until(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<Sleep>().map(Pin::into_inner) {
            Some(ours) => ours.reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

impl hyper::rt::Sleep for Sleep {}

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
        let deadline = Instant::now() + Duration::from_secs(30) + Duration::from_nanos(4321);
        let is_armed = |(shard, slot): (u32, u32)| {
            lock(&wheel().shards[shard as usize]).slots[slot as usize].as_ref().is_some_and(|e| e.deadline == deadline)
        };
        let mut sleep = Box::pin(CoarseSleep::until(deadline));
        assert!(futures_util::poll!(sleep.as_mut()).is_pending());
        let at = sleep.armed.expect("a pending sleep is armed");
        assert!(is_armed(at));
        drop(sleep);
        assert!(!is_armed(at), "dropping it disarms it");
    }

    #[test]
    fn the_sweep_wakes_only_what_expired() {
        let waker = futures_util::task::noop_waker();
        let wheel = Wheel { shards: (0..2).map(|_| Mutex::new(Shard::default())).collect() };
        let now = Instant::now();
        let soon = lock(&wheel.shards[0]).insert(Entry { deadline: now, waker: waker.clone(), woken: false });
        let later =
            lock(&wheel.shards[1]).insert(Entry { deadline: now + Duration::from_secs(9), waker, woken: false });
        sweep(&wheel, now + Duration::from_secs(1));
        let woken = |s: usize, i: u32| lock(&wheel.shards[s]).slots[i as usize].as_ref().is_some_and(|e| e.woken);
        assert!(woken(0, soon));
        assert!(!woken(1, later));
        lock(&wheel.shards[0]).remove(soon);
        assert_eq!(
            lock(&wheel.shards[0]).insert(Entry {
                deadline: now,
                waker: futures_util::task::noop_waker(),
                woken: false
            }),
            soon,
            "slots are reused"
        );
    }
}
