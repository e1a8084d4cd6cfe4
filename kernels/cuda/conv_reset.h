// For tests of the convolution launcher's choices (kernels/cuda/conv.cu): forgets every plan and
// each device's search workspace size, so that the next call of each shape chooses again, as a
// new process would (the on-disk cache and its entries read so far stay). Only while no
// convolution runs.
#pragma once

namespace unetcu::kernels::cuda {

void forget_conv_plans();

}  // namespace unetcu::kernels::cuda
