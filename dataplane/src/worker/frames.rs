//! A received batch lent to the handler ([`FrameHandler::handle_batch`]):
//! the frames one port's RX ring gave in one take, in order, each lent in
//! turn and given back with its [`Action`]. A handler that processes a
//! batch under one set of borrows (the engine's [`crate::engine::Batch`])
//! pays its set-up once per batch instead of once per frame, and may look
//! at frames it has not handled yet ([`Frames::peek`], for staging).
//!
//! Transmits and drops are carried out as each frame is handled. A frame
//! to hold is set aside and queued when the handler returns (queueing one
//! calls the handler back, [`FrameHandler::held`]); frames of one batch
//! held for the same key keep their order.

use std::time::Instant;

use super::{bump, transmit, Action, FrameHandler, HoldKey, LoopStats, RxInfo};
use crate::xsk::{Frame, XskPorts};

/// One batch of received frames, not yet handled.
pub struct Frames<'w> {
    pub(super) ports: &'w mut XskPorts,
    pub(super) frames: std::vec::Drain<'w, Frame>,
    pub(super) rx: RxInfo,
    pub(super) now: Instant,
    pub(super) stats: &'w LoopStats,
    /// Frames to hold, with their keys and lengths: queued by the worker
    /// once the handler returns.
    pub(super) to_hold: &'w mut Vec<(HoldKey, Frame, usize)>,
    pub(super) tx: u64,
    pub(super) dropped: u64,
}

impl std::fmt::Debug for Frames<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frames").field("rx", &self.rx).field("left", &self.len()).finish_non_exhaustive()
    }
}

impl Frames<'_> {
    /// Where the batch came from.
    #[inline]
    pub fn rx(&self) -> RxInfo {
        self.rx
    }

    /// When the batch is handled (read after it was taken from the ring).
    #[inline]
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Frames not handled yet.
    #[inline]
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether every frame was handled.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.frames.len() == 0
    }

    /// The `i`-th frame not handled yet (0: the next one), to look at
    /// before it is handled; `None` past the last.
    #[inline]
    pub fn peek(&mut self, i: usize) -> Option<&[u8]> {
        let frame = self.frames.as_slice().get(i)?;
        let len = frame.len();
        self.ports.frame_mut(frame).get(..len)
    }

    /// Handles the next `n` frames (all that are left if fewer) in order:
    /// `handle` gets each frame's buffer (the whole UMEM frame; the frame
    /// is `buf[..len]`) and says what to do with it.
    #[inline]
    pub fn handle(&mut self, n: usize, mut handle: impl FnMut(&mut [u8], usize) -> Action) {
        let Frames { ports, frames, stats, to_hold, tx, dropped, .. } = self;
        for frame in frames.by_ref().take(n) {
            let len = frame.len();
            match handle(ports.frame_mut(&frame), len) {
                Action::Drop => {
                    ports.recycle(frame);
                    *dropped += 1;
                }
                Action::Consumed => ports.recycle(frame),
                Action::Hold { key, len } => to_hold.push((key, frame, len)),
                Action::Transmit { port, len } => *tx += u64::from(transmit(ports, stats, port, frame, len)),
            }
        }
    }

    /// Hands whatever the handler left to `handler`'s per-frame
    /// [`FrameHandler::handle`], then counts the batch.
    pub(super) fn finish<H: FrameHandler>(mut self, handler: &mut H) {
        let (rx, now) = (self.rx, self.now);
        self.handle(usize::MAX, |buf, len| handler.handle(buf, len, rx, now));
        bump(&self.stats.tx_frames, self.tx);
        bump(&self.stats.dropped, self.dropped);
    }
}
