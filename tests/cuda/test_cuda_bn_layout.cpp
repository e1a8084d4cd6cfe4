// Placeholder: the CUDA bn layout/bfloat16 tests are written here.
#include <doctest/doctest.h>
