// Placeholder: the misc layout/bfloat16 tests are written here.
#include <doctest/doctest.h>
