// Evaluates the kernels' det_log (csrc/kernels/det_log.h) for tests/ops/test_det_log.py: one
// double per input line (any strtod format, hexadecimal included), one line of output per input:
// the float32 result's bit pattern as 8 hexadecimal digits.
#include <cstdio>
#include <cstdlib>

#include "kernels/det_log.h"

int main() {
  char line[128];
  while (std::fgets(line, sizeof(line), stdin)) {
    const double x = std::strtod(line, nullptr);
    std::printf("%08x\n", static_cast<unsigned>(mask_replay::float_bits(mask_replay::det_log(x))));
  }
  return 0;
}
