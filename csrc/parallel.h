// Splitting a handler's work over the XLA FFI thread pool.
//
// ParallelFor cuts [0, n) into chunks that the calling thread and up to (pool threads - 1) pool
// tasks claim from a shared counter, so a participant the OS delays leaves its share to the
// others. An ffi::Future is completed by a countdown over chunks: whoever finishes the last one
// runs the optional `finish` step (e.g. a deterministic cross-chunk reduction: chunk c always
// covers the same range, whoever ran it) and then resolves the future, so a pool task that wakes
// after every chunk is claimed delays nothing (it finds no chunk and touches no buffer). The pool
// may also run tasks inline, so nothing here assumes a task runs elsewhere.
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

inline int64_t Workers(const ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// Number of chunks for n items of which each chunk should hold at least `grain`: up to
// kOversplit per worker, for balance.
constexpr int64_t kOversplit = 4;
inline int64_t NumChunks(const ffi::ThreadPool& pool, int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  return std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, kOversplit * Workers(pool));
}

// body(chunk, begin, end) -> ffi::Error over [begin, end) slices of [0, n); finish() -> ffi::Error
// runs once after every chunk succeeded.
template <typename Body, typename Finish>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t num_chunks, Body body, Finish finish) {
  if (num_chunks <= 1) {
    ffi::Error err = n > 0 ? body(0, 0, n) : ffi::Error::Success();
    if (err.success()) err = finish();
    return ReadyFuture(std::move(err));
  }
  struct State {
    Body body;
    Finish finish;
    int64_t n, chunks;
    std::atomic<int64_t> next{0}, unfinished;
    std::mutex mu;
    ffi::Error error = ffi::Error::Success();
    ffi::Promise promise;
    State(Body b, Finish f, int64_t n_, int64_t c)
        : body(std::move(b)), finish(std::move(f)), n(n_), chunks(c), unfinished(c) {}
    void Run() {
      for (int64_t chunk = next.fetch_add(1); chunk < chunks; chunk = next.fetch_add(1)) {
        ffi::Error err = body(chunk, n * chunk / chunks, n * (chunk + 1) / chunks);
        if (!err.success()) {
          std::lock_guard<std::mutex> lock(mu);
          if (error.success()) error = std::move(err);
        }
        if (unfinished.fetch_sub(1, std::memory_order_acq_rel) == 1) Complete();
      }
    }
    void Complete() {
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
  const int64_t participants = std::min(num_chunks, Workers(pool));
  auto state = std::make_shared<State>(std::move(body), std::move(finish), n, num_chunks);
  ffi::Future future(state->promise);
  for (int64_t p = 1; p < participants; ++p) pool.Schedule([state] { state->Run(); });
  state->Run();
  return future;
}

template <typename Body>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t num_chunks, Body body) {
  return ParallelFor(pool, n, num_chunks, std::move(body), [] { return ffi::Error::Success(); });
}

}  // namespace tunix_rt
