// For tests of the convolution launcher's choices (kernels/cuda/conv.cu).
#pragma once

namespace unetcu::kernels::cuda {

// Forgets every plan and each device's search workspace size, so that the next call of each
// shape chooses again, as a new process would (the on-disk cache and its entries read so far
// stay). Only while no convolution runs.
void forget_conv_plans();

// How many algorithm searches (cudnnFind* calls) this process has run.
int conv_searches();

}  // namespace unetcu::kernels::cuda
