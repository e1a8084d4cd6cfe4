// PyTorch's own files read without Python: the state_dict a `torch.save` zip archive holds
// (`.pth`/`.pt`, PyTorch 1.6 and later, as torchvision and timm write them).
//
// The archive (read with libzip) holds `<name>/data.pkl`, the pickled state_dict, and one
// record `<name>/data/<key>` per storage. The pickle is read by an unpickler of our own that
// knows only what a state_dict needs: the opcodes of pickle protocols 2 to 5 that build
// tuples, lists, dicts, strings and numbers, and the globals collections.OrderedDict,
// torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter and torch's storage
// types. It runs nothing: a pickle that names any other global (os.system, builtins.eval, ...)
// is refused when that global is read. Each tensor is copied out of its storage honouring its
// offset, size and stride, and the archive's byte order; float16 and bfloat16 become float32.
// Everything read is checked (record names and sizes, opcodes, memo indices, shapes, strides
// within the storage) and a bad file is refused with one message naming it.
#pragma once
#include <cstddef>
#include <string>

#include "engine/checkpoint.h"

namespace unetcu {

// Whether the file starts as a torch.save file does: a zip archive ("PK\3\4") or the legacy
// format (pickle protocol 2 and torch's magic number); false for a missing file.
bool is_torch_file(const std::string& path);

// The tensors of the state_dict in a torch.save archive, by name, as SafeTensors (dtype F32,
// F64 or I64; other integer types keep their bytes under I32, I16, I8, U8 or BOOL). Entries
// that are not tensors are left out. A top-level dict holding the state_dict under
// "state_dict" or "model" (training checkpoints) gives that one. Throws unetcu::Error naming
// `path` for a file that is not such an archive: a legacy (before PyTorch 1.6) file, with how
// to re-save it; a TorchScript archive; a truncated or malformed one; a forbidden global.
SafeTensors read_torch_file(const std::string& path);

// The same from the archive's bytes in memory (the fuzz target); `what` names it in messages.
SafeTensors read_torch_bytes(const void* data, size_t size, const std::string& what);

}  // namespace unetcu
