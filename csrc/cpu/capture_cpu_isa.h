// Which vector path capture's CPU kernel runs, for build_info (csrc/ops.cpp). Defined next to the
// dispatch (capture_cpu.cpp), so the report and the loops read the same switch.
#pragma once
#include <string>

namespace mask_replay {
namespace cpu {

// JSON members (no braces): "cpu_isa" (the path capture runs now: avx512, avx2 or baseline),
// "cpu_build_isa" (what the extension was compiled for) and "cpu_avx512" (used, disabled-by-env,
// unsupported-cpu or not-built). Read on every call: MASK_REPLAY_NO_AVX512 may change at run time.
std::string capture_isa_json();

}  // namespace cpu
}  // namespace mask_replay
