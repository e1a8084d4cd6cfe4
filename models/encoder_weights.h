// Pretrained encoder weights from the files users have (unet_train --encoder-weights FILE):
//  - torch.save archives (.pth/.pt, engine/torch_file.h), as torchvision and timm write them;
//  - safetensors files under torchvision's names (the model.safetensors SMP hosts for each
//    encoder: conv1.weight, layer1.0.bn1.running_mean, ...) or under SMP's encoder.* names
//    (unetcu's own checkpoints, tools/pytorch_reference.py export-encoder).
// torchvision's classifier (fc.*) and every entry outside the encoder are left out, and a
// missing num_batches_tracked counts from 0. Every tensor the model's encoder has is checked
// first: one missing or of the wrong shape is one error naming it, the file and the shape
// --encoder needs (and, where the file's layers say so, the depth it holds). A model of other
// than 3 input channels gets the first convolution adapted as SMP's patch_first_conv does: 1
// channel sums the three; N channels repeat them cyclically, scaled by 3 / N.
#pragma once
#include <string>

#include "engine/checkpoint.h"
#include "models/unet.h"

namespace unetcu {

// The encoder entries of `file` under SMP's names (encoder.*), adapted to `model`, checked
// against its names and shapes, as load_model_state(model, ..., "encoder.") loads them.
// The model is any module with SMP's encoder.* entries (a UNet, or a strategy's model); its
// encoder's depth and input channels are read from those.
SafeTensors read_encoder_weights(const std::string& file, const Module& model);

// Loads them into the model's encoder.
void load_encoder_weights(Module& model, const std::string& file);

// SMP's patch_first_conv: a 3-channel first convolution's weight [O, 3, k, k] (float32 or
// float64) for `in_channels` input channels.
SafeTensor adapt_first_conv(const SafeTensor& weight, int in_channels);

}  // namespace unetcu
