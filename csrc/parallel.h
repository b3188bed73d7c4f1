// Splitting a handler's work over the XLA FFI thread pool.
//
// ParallelFor returns an ffi::Future completed by a countdown: the last chunk to finish runs the
// optional `finish` step (e.g. a deterministic cross-chunk reduction) and then resolves the
// future. Chunk 0 always runs on the calling thread, and the pool itself may run tasks inline, so
// nothing here assumes a task runs elsewhere.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace tunix_rt {

namespace ffi = xla::ffi;

inline ffi::Future ReadyFuture(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

// Number of chunks for n items of which each chunk should hold at least `grain`.
inline int64_t NumChunks(const ffi::ThreadPool& pool, int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  return std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, workers);
}

// body(chunk, begin, end) -> ffi::Error over [begin, end) slices of [0, n); finish() -> ffi::Error
// runs once after every chunk succeeded.
template <typename Body, typename Finish>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t num_chunks, Body body,
                        Finish finish) {
  if (num_chunks <= 1) {
    ffi::Error err = n > 0 ? body(0, 0, n) : ffi::Error::Success();
    if (err.success()) err = finish();
    return ReadyFuture(std::move(err));
  }
  struct State {
    Body body;
    Finish finish;
    int64_t n, chunks;
    std::atomic<int64_t> remaining;
    std::mutex mu;
    ffi::Error error = ffi::Error::Success();
    ffi::Promise promise;
    State(Body b, Finish f, int64_t n_, int64_t c)
        : body(std::move(b)), finish(std::move(f)), n(n_), chunks(c), remaining(c) {}
    void Run(int64_t chunk) {
      const int64_t begin = n * chunk / chunks, end = n * (chunk + 1) / chunks;
      ffi::Error err = body(chunk, begin, end);
      if (!err.success()) {
        std::lock_guard<std::mutex> lock(mu);
        if (error.success()) error = std::move(err);
      }
      if (remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      ffi::Error final_error = ffi::Error::Success();
      {
        std::lock_guard<std::mutex> lock(mu);
        final_error = error;
      }
      if (final_error.success()) final_error = finish();
      if (final_error.success()) {
        promise.SetAvailable();
      } else {
        promise.SetError(std::move(final_error));
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body), std::move(finish), n, num_chunks);
  ffi::Future future(state->promise);
  for (int64_t c = 1; c < num_chunks; ++c) {
    pool.Schedule([state, c] { state->Run(c); });
  }
  state->Run(0);
  return future;
}

template <typename Body>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t num_chunks, Body body) {
  return ParallelFor(pool, n, num_chunks, std::move(body), [] { return ffi::Error::Success(); });
}

}  // namespace tunix_rt
