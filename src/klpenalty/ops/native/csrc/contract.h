// The op contract of klpenalty/ops/contract.py as the C++ sources see it: the want bits and the
// columns of out (..., 4), stats (..., 10) and state (N, 6). One constant per line,
// `constexpr int64_t k<Name> = <value>;`, <Name> the Python name without its underscores
// (case aside: Want.KL is kWantKL, ST_LOG_S_X is kStLogSX); tests/ops/native/test_csrc.py
// compares every one with contract.py.
#pragma once

#include <cstdint>

namespace klpenalty_native {

// Want: which columns of out a call computes; bit i is column i
constexpr int64_t kWantKL = 1;
constexpr int64_t kWantLogp = 2;
constexpr int64_t kWantRefLogp = 4;
constexpr int64_t kWantEntropy = 8;

// out (..., 4): KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃)
constexpr int64_t kOutCols = 4;
constexpr int64_t kOutKL = 0;
constexpr int64_t kOutLogp = 1;
constexpr int64_t kOutRefLogp = 2;
constexpr int64_t kOutEntropy = 3;

// stats (..., 10), what the backward reads
constexpr int64_t kStatsCols = 10;
constexpr int64_t kStShiftX = 0;    // finite max of the policy logits on the support (0 if none)
constexpr int64_t kStLogSX = 1;     // log Σ e^u
constexpr int64_t kStShiftY = 2;
constexpr int64_t kStLogSY = 3;
constexpr int64_t kStMeanD = 4;     // E_π̃[u − w]
constexpr int64_t kStCareful = 5;   // 1 where the row needs the 0·log 0 arithmetic
constexpr int64_t kStMeanU = 6;     // E_π̃[u]
constexpr int64_t kStLogp = 7;      // log π̃(t)
constexpr int64_t kStRefLogp = 8;   // log ρ(t)
constexpr int64_t kStTau = 9;       // the support's threshold (−inf: none)

// state (N, 6): the engine's unfinalized row state (maxima in logit units, sums against them)
constexpr int64_t kStateCols = 6;
constexpr int64_t kSxMX = 0;
constexpr int64_t kSxSX = 1;
constexpr int64_t kSxMY = 2;
constexpr int64_t kSxSY = 3;
constexpr int64_t kSxA = 4;
constexpr int64_t kSxB = 5;

}  // namespace klpenalty_native
