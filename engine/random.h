// Deterministic random numbers, identical on every platform (std:: distributions are not):
// xoshiro256** seeded through SplitMix64, Box-Muller normals.
#pragma once
#include <cmath>
#include <cstdint>

namespace unetcu {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) {
    for (auto& s : s_) s = splitmix(seed);
  }
  // A seed derived from several integers (seed, epoch, index, ...).
  static uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t x = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
    return splitmix(x);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int64_t below(int64_t n) { return int64_t(uniform() * double(n)); }  // [0, n)
  double normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1)), th = 6.283185307179586 * u2;
    spare_ = r * std::sin(th);
    have_spare_ = true;
    return r * std::cos(th);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static uint64_t splitmix(uint64_t& x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  static uint64_t splitmix(uint64_t&& x) { return splitmix(x); }
  uint64_t s_[4];
  bool have_spare_ = false;
  double spare_ = 0;
};

}  // namespace unetcu
