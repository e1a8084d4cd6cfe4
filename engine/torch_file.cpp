#include "engine/torch_file.h"

#include <zip.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "bodies/bf16.h"

namespace unetcu {
namespace {

[[noreturn]] void bad(const std::string& what, const std::string& why) {
  throw Error(str_cat("torch file '", what, "': ", why));
}

// ---- the archive ---------------------------------------------------------------------------

// A torch.save archive opened read-only; its records by name. torch.save stores every record
// uncompressed, and only such records are read: a record's size is then its size in the file.
class Archive {
 public:
  // Takes the archive over: it is discarded however the constructor or a read ends.
  Archive(zip_t* zip, std::string what) : zip_(zip, zip_discard), what_(std::move(what)) {
    const zip_int64_t n = zip_get_num_entries(zip_.get(), 0);
    if (n <= 0) bad(what_, "is an empty zip archive, not a torch.save file");
    for (zip_int64_t i = 0; i < n; ++i) {
      const char* name = zip_get_name(zip_.get(), zip_uint64_t(i), 0);
      if (name) names_.emplace(name, zip_uint64_t(i));
    }
  }
  Archive(const Archive&) = delete;
  Archive& operator=(const Archive&) = delete;

  bool has(const std::string& name) const { return names_.count(name) > 0; }
  const std::map<std::string, zip_uint64_t>& names() const { return names_; }

  // The record's bytes; at most `limit` of them are wanted (a larger record is an error).
  std::string read(const std::string& name, uint64_t limit) const {
    const auto it = names_.find(name);
    if (it == names_.end()) bad(what_, "has no record '" + name + "'");
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(zip_.get(), it->second, 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE) ||
        !(st.valid & ZIP_STAT_COMP_METHOD))
      bad(what_, "cannot read the size of record '" + name + "'");
    if (st.comp_method != ZIP_CM_STORE)
      bad(what_, "record '" + name + "' is compressed; torch.save stores its records uncompressed");
    if (st.size > limit)
      bad(what_, str_cat("record '", name, "' holds ", st.size, " bytes, more than the ", limit, " expected"));
    std::unique_ptr<zip_file_t, int (*)(zip_file_t*)> f(zip_fopen_index(zip_.get(), it->second, 0), zip_fclose);
    if (!f) bad(what_, "cannot open record '" + name + "': " + zip_strerror(zip_.get()));
    std::string out(size_t(st.size), '\0');
    size_t got = 0;
    while (got < out.size()) {
      const zip_int64_t r = zip_fread(f.get(), &out[got], out.size() - got);
      if (r <= 0) bad(what_, "record '" + name + "' is truncated");
      got += size_t(r);
    }
    return out;
  }

 private:
  std::unique_ptr<zip_t, void (*)(zip_t*)> zip_;
  std::string what_;
  std::map<std::string, zip_uint64_t> names_;
};

// ---- the unpickler -------------------------------------------------------------------------

// Element types of torch's storages, by the storage class a pickle names.
struct StorageType {
  const char* name;  // "FloatStorage"
  const char* dtype;  // SafeTensor's
  int bytes;
  enum Convert { None, Half, BFloat16 } convert;
};
constexpr StorageType kStorageTypes[] = {
    {"FloatStorage", "F32", 4, StorageType::None},   {"DoubleStorage", "F64", 8, StorageType::None},
    {"HalfStorage", "F32", 2, StorageType::Half},    {"BFloat16Storage", "F32", 2, StorageType::BFloat16},
    {"LongStorage", "I64", 8, StorageType::None},    {"IntStorage", "I32", 4, StorageType::None},
    {"ShortStorage", "I16", 2, StorageType::None},   {"CharStorage", "I8", 1, StorageType::None},
    {"ByteStorage", "U8", 1, StorageType::None},     {"BoolStorage", "BOOL", 1, StorageType::None},
};

// The unpickler's values. Each lives in its unpickler's arena (a pickle can make a container
// hold itself: owning pointers would leak such a cycle) and is referred to by plain pointers.
struct Obj;
using Py = Obj*;
struct Obj {
  enum Kind { None, Bool, Int, Float, Str, Tuple, List, Dict, Global, Storage, Tensor } kind = None;
  int64_t i = 0;                        // Bool, Int; Storage: its element count
  double f = 0;                         // Float
  std::string s;                        // Str; Global: "module.name"; Storage: its record key
  const StorageType* storage = nullptr;  // Global of a storage class; Storage
  std::vector<Py> items;                // Tuple, List
  std::vector<std::pair<Py, Py>> dict;  // Dict, in insertion order
  SafeTensor tensor;                    // Tensor
};
constexpr size_t kMaxStack = size_t(1) << 20;  // values on the stack, in the memo and made, each
constexpr int kMaxDims = 8;

class Unpickler {
 public:
  Unpickler(const std::string& pickle, const Archive& archive, std::string prefix, bool big_endian, std::string what)
      : p_(pickle), archive_(archive), prefix_(std::move(prefix)), big_(big_endian), what_(std::move(what)) {}

  Py make(Obj::Kind k) {
    if (arena_.size() >= kMaxStack) fail("more values than a state_dict holds");
    arena_.push_back(std::make_unique<Obj>());
    arena_.back()->kind = k;
    return arena_.back().get();
  }

  Py load() {
    for (;;) {
      const uint8_t op = byte();
      switch (op) {
        case 0x80: {  // PROTO
          const int v = byte();
          if (v < 2 || v > 5) fail(str_cat("pickle protocol ", v, " (torch.save writes 2)"));
          break;
        }
        case 0x95: take(8); break;  // FRAME: a length hint
        case 'c': {                 // GLOBAL "module\nname\n"
          const std::string module = line(), name = line();
          push(global(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const Py name = pop(), module = pop();
          if (module->kind != Obj::Str || name->kind != Obj::Str) fail("STACK_GLOBAL of non-strings");
          push(global(module->s, name->s));
          break;
        }
        case 'q': memo_put(byte()); break;       // BINPUT
        case 'r': memo_put(u32()); break;        // LONG_BINPUT
        case 0x94: memo_put(memo_.size()); break;  // MEMOIZE
        case 'h': push(memo_get(byte())); break;  // BINGET
        case 'j': push(memo_get(u32())); break;   // LONG_BINGET
        case '}': push(make(Obj::Dict)); break;
        case ']': push(make(Obj::List)); break;
        case ')': push(make(Obj::Tuple)); break;
        case '(': marks_.push_back(stack_.size()); break;
        case 'X': push(str(take(u32()))); break;      // BINUNICODE
        case 0x8c: push(str(take(byte()))); break;    // SHORT_BINUNICODE
        case 0x8d: push(str(take(u64()))); break;     // BINUNICODE8
        case 'J': push(integer(int32_t(u32()))); break;  // BININT
        case 'K': push(integer(byte())); break;          // BININT1
        case 'M': {  // BININT2 (two reads, in order: the operands of | are unsequenced)
          const int lo = byte(), hi = byte();
          push(integer(lo | hi << 8));
          break;
        }
        case 0x8a: push(integer(long1())); break;        // LONG1
        case 'G': {                                      // BINFLOAT, big-endian
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | byte();
          Py o = make(Obj::Float);
          std::memcpy(&o->f, &bits, 8);
          push(o);
          break;
        }
        case 'N': push(make(Obj::None)); break;
        case 0x88: case 0x89: {  // NEWTRUE, NEWFALSE
          Py o = make(Obj::Bool);
          o->i = op == 0x88;
          push(o);
          break;
        }
        case 't': push(tuple(pop_mark())); break;  // TUPLE
        case 0x85: case 0x86: case 0x87: {          // TUPLE1..3
          std::vector<Py> v(size_t(op - 0x84));
          for (size_t k = v.size(); k-- > 0;) v[k] = pop();
          push(tuple(std::move(v)));
          break;
        }
        case 'l': {  // LIST
          Py o = make(Obj::List);
          o->items = pop_mark();
          push(o);
          break;
        }
        case 'd': {  // DICT
          Py o = make(Obj::Dict);
          set_items(o, pop_mark());
          push(o);
          break;
        }
        case 'a': {  // APPEND
          const Py v = pop();
          list_top()->items.push_back(v);
          break;
        }
        case 'e': {  // APPENDS
          std::vector<Py> v = pop_mark();
          Py l = list_top();
          l->items.insert(l->items.end(), v.begin(), v.end());
          break;
        }
        case 's': {  // SETITEM
          const Py v = pop(), k = pop();
          set_items(dict_top(), {k, v});
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<Py> kv = pop_mark();
          set_items(dict_top(), std::move(kv));
          break;
        }
        case 'R': {  // REDUCE
          const Py args = pop(), callable = pop();
          push(reduce(callable, args));
          break;
        }
        case 'b': pop(); top(); break;  // BUILD: the state (a state_dict's _metadata) is not needed
        case 'Q': push(persistent(pop())); break;  // BINPERSID
        case '0': pop(); break;                    // POP
        case '1': pop_mark(); break;               // POP_MARK
        case '2': push(top()); break;              // DUP
        case '.': {                                // STOP
          if (stack_.size() != 1 || !marks_.empty()) fail("the pickle ends with an unbalanced stack");
          return stack_.back();
        }
        default: fail(str_cat("opcode 0x", hex(op), " at byte ", pos_ - 1, ", not one a state_dict needs"));
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { bad(what_, "data.pkl: " + why); }
  static std::string hex(uint8_t v) {
    const char* d = "0123456789abcdef";
    return {d[v >> 4], d[v & 15]};
  }
  uint8_t byte() {
    if (pos_ >= p_.size()) fail("ends before its STOP");
    return uint8_t(p_[pos_++]);
  }
  std::string take(uint64_t n) {
    if (n > p_.size() - pos_) fail("a string runs past the end");
    std::string s = p_.substr(pos_, size_t(n));
    pos_ += size_t(n);
    return s;
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= uint32_t(byte()) << (8 * k);
    return v;
  }
  uint64_t u64() {
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= uint64_t(byte()) << (8 * k);
    return v;
  }
  int64_t long1() {  // n bytes, little-endian two's complement
    const int n = byte();
    if (n > 8) fail(str_cat("an integer of ", n, " bytes"));
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= uint64_t(byte()) << (8 * k);
    if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t(0) << (8 * n);  // sign-extend
    return int64_t(v);
  }
  std::string line() {
    const size_t end = p_.find('\n', pos_);
    if (end == std::string::npos || end - pos_ > 256) fail("a GLOBAL's name is not a line");
    std::string s = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  Py str(std::string s) {
    Py o = make(Obj::Str);
    o->s = std::move(s);
    return o;
  }
  Py integer(int64_t v) {
    Py o = make(Obj::Int);
    o->i = v;
    return o;
  }
  Py tuple(std::vector<Py> v) {
    Py o = make(Obj::Tuple);
    o->items = std::move(v);
    return o;
  }
  void push(Py o) {
    if (stack_.size() >= kMaxStack) fail("more values than a state_dict holds");
    stack_.push_back(std::move(o));
  }
  Py pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("pops an empty stack");
    Py o = std::move(stack_.back());
    stack_.pop_back();
    return o;
  }
  const Py& top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("reads an empty stack");
    return stack_.back();
  }
  std::vector<Py> pop_mark() {
    if (marks_.empty()) fail("no MARK to go back to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Py> v(stack_.begin() + std::ptrdiff_t(m), stack_.end());
    stack_.resize(m);
    return v;
  }
  Py list_top() {
    const Py& l = top();
    if (l->kind != Obj::List) fail("appends to something not a list");
    return l;
  }
  Py dict_top() {
    const Py& d = top();
    if (d->kind != Obj::Dict) fail("sets an item of something not a dict");
    return d;
  }
  void set_items(const Py& d, std::vector<Py> kv) {
    if (kv.size() % 2) fail("a dict's items are not key-value pairs");
    for (size_t k = 0; k < kv.size(); k += 2) d->dict.emplace_back(std::move(kv[k]), std::move(kv[k + 1]));
    if (d->dict.size() > kMaxStack) fail("more values than a state_dict holds");
  }
  void memo_put(uint64_t k) {
    if (k >= kMaxStack) fail(str_cat("memo index ", k));
    memo_[k] = top();
  }
  Py memo_get(uint64_t k) {
    const auto it = memo_.find(k);
    if (it == memo_.end()) fail(str_cat("reads memo ", k, ", never written"));
    return it->second;
  }

  // The only globals a state_dict names; any other is refused here, before anything uses it.
  Py global(const std::string& module, const std::string& name) {
    Py g = make(Obj::Global);
    g->s = module + "." + name;
    if (g->s == "collections.OrderedDict" || g->s == "torch._utils._rebuild_tensor_v2" ||
        g->s == "torch._utils._rebuild_parameter")
      return g;
    if (module == "torch")
      for (const StorageType& t : kStorageTypes)
        if (name == t.name) {
          g->storage = &t;
          return g;
        }
    bad(what_, "its pickle names the global '" + g->s +
                   "', which no state_dict needs; refused without running anything (a state_dict names only "
                   "collections.OrderedDict, torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter "
                   "and torch's storage types)");
  }

  Py reduce(const Py& callable, const Py& args) {
    if (callable->kind != Obj::Global || callable->storage) fail("calls something that is not a known function");
    if (args->kind != Obj::Tuple) fail("calls " + callable->s + " without an argument tuple");
    const std::vector<Py>& a = args->items;
    if (callable->s == "collections.OrderedDict") {
      if (!a.empty()) fail("OrderedDict with arguments");
      return make(Obj::Dict);
    }
    if (callable->s == "torch._utils._rebuild_parameter") {
      if (a.size() != 3 || a[0]->kind != Obj::Tensor) fail("_rebuild_parameter without a tensor");
      return a[0];
    }
    // torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
    if (a.size() < 6 || a.size() > 7 || a[0]->kind != Obj::Storage || a[1]->kind != Obj::Int ||
        a[2]->kind != Obj::Tuple || a[3]->kind != Obj::Tuple)
      fail("_rebuild_tensor_v2 with arguments other than a tensor's");
    return rebuild_tensor(*a[0], a[1]->i, *a[2], *a[3]);
  }

  // ('storage', StorageType, key, location, numel)
  Py persistent(const Py& pid) {
    const std::vector<Py>& t = pid->items;
    if (pid->kind != Obj::Tuple || t.size() != 5 || t[0]->kind != Obj::Str || t[0]->s != "storage" ||
        t[1]->kind != Obj::Global || !t[1]->storage || t[2]->kind != Obj::Str || t[4]->kind != Obj::Int)
      fail("a persistent id that is not a storage");
    if (t[4]->i < 0) fail(str_cat("storage '", t[2]->s, "' of ", t[4]->i, " elements"));
    Py s = make(Obj::Storage);
    s->storage = t[1]->storage;
    s->s = t[2]->s;
    s->i = t[4]->i;
    return s;
  }

  // A storage's bytes, read once however many tensors view it.
  const std::string& storage_bytes(const Obj& s) {
    const uint64_t want = uint64_t(s.i) * uint64_t(s.storage->bytes);
    auto it = storages_.find(s.s);
    if (it != storages_.end()) {  // another view of it: the same type and size, or a forged pickle
      if (it->second.size() != want) fail("storage '" + s.s + "' is named again with another type or size");
      return it->second;
    }
    std::string bytes = archive_.read(prefix_ + "data/" + s.s, want);
    if (bytes.size() != want)
      bad(what_, str_cat("record '", prefix_, "data/", s.s, "' holds ", bytes.size(), " bytes, its storage ", want));
    return storages_.emplace(s.s, std::move(bytes)).first->second;
  }

  Py rebuild_tensor(const Obj& storage, int64_t offset, const Obj& size, const Obj& stride) {
    if (size.items.size() != stride.items.size() || size.items.size() > size_t(kMaxDims))
      fail("a tensor's size and stride do not match");
    const StorageType& type = *storage.storage;
    Shape shape;
    std::vector<int64_t> strides;
    constexpr int64_t kMaxExtent = int64_t(1) << 40;
    bool empty = false;
    for (size_t d = 0; d < size.items.size(); ++d) {
      const Obj &n = *size.items[d], &st = *stride.items[d];
      if (n.kind != Obj::Int || st.kind != Obj::Int || n.i < 0 || st.i < 0 || n.i > kMaxExtent || st.i > kMaxExtent)
        fail("a tensor's size or stride is out of range");
      shape.push_back(n.i);
      strides.push_back(st.i);
      empty = empty || n.i == 0;
    }
    if (!empty) {  // every element within the storage (128-bit: no product overflows)
      __int128 numel = 1, last = offset;
      for (size_t d = 0; d < shape.size(); ++d) {
        numel *= shape[d];
        last += __int128(shape[d] - 1) * strides[d];
      }
      if (offset < 0 || last >= storage.i) fail("a tensor reaches past the end of its storage");
      if (numel > storage.i) fail("a tensor has more elements than its storage");
    }
    int64_t numel = 1;
    for (int64_t n : shape) numel *= n;  // at most the storage's count, or 0
    Py o = make(Obj::Tensor);
    SafeTensor& t = o->tensor;
    t.dtype = type.dtype;
    t.shape = shape;
    const int out_bytes = type.convert == StorageType::None ? type.bytes : 4;
    t.data.resize(empty ? 0 : size_t(numel) * size_t(out_bytes));
    if (empty) return o;
    const char* src = storage_bytes(storage).data();
    std::vector<int64_t> index(shape.size(), 0);
    for (int64_t e = 0; e < numel; ++e) {
      int64_t at = offset;
      for (size_t d = 0; d < shape.size(); ++d) at += index[d] * strides[d];
      char elem[8];
      const char* from = src + size_t(at) * size_t(type.bytes);
      for (int k = 0; k < type.bytes; ++k) elem[k] = from[big_ ? type.bytes - 1 - k : k];
      char* dst = t.data.data() + size_t(e) * size_t(out_bytes);
      if (type.convert == StorageType::None) {
        std::memcpy(dst, elem, size_t(type.bytes));
      } else {
        uint16_t h;
        std::memcpy(&h, elem, 2);
        const float v = type.convert == StorageType::Half ? half_to_float(h) : kernels::bits_float(uint32_t(h) << 16);
        std::memcpy(dst, &v, 4);
      }
      for (size_t d = shape.size(); d-- > 0;) {  // the next index, row-major
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
    return o;
  }

  static float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 0) {
      if (mant == 0) {
        bits = sign;
      } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = mant;
        do {
          ++e;
          m <<= 1;
        } while (!(m & 1024));
        bits = sign | uint32_t(127 - 15 - e) << 23 | (m & 1023) << 13;
      }
    } else if (exp == 31) {
      bits = sign | 0x7f800000u | mant << 13;
    } else {
      bits = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const std::string& p_;
  size_t pos_ = 0;
  const Archive& archive_;
  std::string prefix_;
  bool big_;
  std::string what_;
  std::vector<Py> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, Py> memo_;
  std::map<std::string, std::string> storages_;
  std::vector<std::unique_ptr<Obj>> arena_;
};

constexpr uint64_t kMaxPickleBytes = uint64_t(64) << 20;

SafeTensors read_archive(zip_t* zip, const std::string& what) {
  Archive archive(zip, what);
  // The records sit in one folder, named as the file was when saved: <name>/data.pkl.
  std::string prefix;
  bool torchscript = false;
  for (const auto& [name, index] : archive.names()) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) continue;
    const std::string rest = name.substr(slash + 1);
    if (rest == "data.pkl") {
      if (!prefix.empty()) bad(what, "holds more than one data.pkl");
      prefix = name.substr(0, slash + 1);
    }
    torchscript = torchscript || rest == "constants.pkl" || rest.rfind("code/", 0) == 0;
  }
  if (torchscript)
    bad(what, "is a TorchScript archive (torch.jit.save), not a state_dict; save model.state_dict() with torch.save");
  if (prefix.empty()) bad(what, "is a zip archive without a data.pkl: not a torch.save file");
  bool big_endian = false;
  if (archive.has(prefix + "byteorder")) {
    const std::string order = archive.read(prefix + "byteorder", 16);
    if (order != "little" && order != "big") bad(what, "records the byte order '" + order + "'");
    big_endian = order == "big";
  }
  const std::string pickle = archive.read(prefix + "data.pkl", kMaxPickleBytes);
  Unpickler unpickler(pickle, archive, prefix, big_endian, what);  // owns every value until the end
  Py root = unpickler.load();
  if (root->kind != Obj::Dict) bad(what, "does not hold a dict (a state_dict)");
  for (const auto& [k, v] : root->dict)  // a training checkpoint's state_dict
    if (k->kind == Obj::Str && (k->s == "state_dict" || k->s == "model") && v->kind == Obj::Dict) {
      root = v;
      break;
    }
  SafeTensors out;
  for (const auto& [k, v] : root->dict)
    if (k->kind == Obj::Str && v->kind == Obj::Tensor) out[k->s] = v->tensor;
  if (out.empty()) bad(what, "holds no tensors");
  return out;
}

// The first bytes of a legacy (before PyTorch 1.6) torch.save file: pickle protocol 2, then
// the magic number 0x1950a86a20f9469cfc6c as a LONG1 of 10 bytes.
constexpr char kLegacyMagic[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";
constexpr size_t kLegacyMagicBytes = sizeof kLegacyMagic - 1;
bool legacy_header(const std::string& head) {
  return head.size() >= kLegacyMagicBytes && std::memcmp(head.data(), kLegacyMagic, kLegacyMagicBytes) == 0;
}

std::string first_bytes(const std::string& path, size_t n) {
  std::ifstream f(path, std::ios::binary);
  std::string head(n, '\0');
  f.read(&head[0], std::streamsize(n));
  head.resize(f ? n : size_t(std::max<std::streamsize>(f.gcount(), 0)));
  return head;
}

[[noreturn]] void refuse_legacy(const std::string& what) {
  bad(what, "is in the legacy torch.save format (before PyTorch 1.6); re-save it as a zip archive with PyTorch 1.6 "
            "or later: torch.save(torch.load(OLD), NEW)");
}

zip_t* open_source(zip_source_t* src, const std::string& what) {
  zip_error_t err;
  zip_error_init(&err);
  zip_t* zip = zip_open_from_source(src, ZIP_RDONLY | ZIP_CHECKCONS, &err);
  if (!zip) {
    zip_source_free(src);
    const std::string why = zip_error_strerror(&err);
    zip_error_fini(&err);
    bad(what, "is not a readable zip archive (" + why + ")");
  }
  zip_error_fini(&err);
  return zip;
}

}  // namespace

bool is_torch_file(const std::string& path) {
  const std::string head = first_bytes(path, kLegacyMagicBytes);
  return head.rfind("PK\x03\x04", 0) == 0 || legacy_header(head);
}

SafeTensors read_torch_bytes(const void* data, size_t size, const std::string& what) {
  const std::string head(static_cast<const char*>(data), std::min(size, kLegacyMagicBytes));
  if (legacy_header(head)) refuse_legacy(what);
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_buffer_create(size ? data : "", size, 0, &err);
  zip_error_fini(&err);
  if (!src) bad(what, "cannot be read");
  return read_archive(open_source(src, what), what);
}

SafeTensors read_torch_file(const std::string& path) {
  if (!std::ifstream(path, std::ios::binary)) bad(path, "cannot be opened");
  if (legacy_header(first_bytes(path, kLegacyMagicBytes))) refuse_legacy(path);
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_file_create(path.c_str(), 0, -1, &err);
  zip_error_fini(&err);
  if (!src) bad(path, "cannot be opened");
  return read_archive(open_source(src, path), path);
}

}  // namespace unetcu
