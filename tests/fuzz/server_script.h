// The input language of the server harness (fuzz_server.cc): a script of client actions on up
// to four connections to one in-process gpulazy-server. Shared with the seed-corpus generator
// (make_corpus.cc), which writes scripts with ScriptWriter; docs/hostile-input.md describes it.
//
// A script is a sequence of actions: an op byte (taken modulo kOpCount), a slot byte (modulo
// kSlots), a request-id byte (the id of the frame the action sends, if any), then the op's
// operands.
// Operands are read as the op needs them; past the end of the input every byte reads as 0, so
// any byte string is a script.
//
// Compatibility: ops are only ever appended before kOpCount, never renumbered. Appending one
// changes kOpCount, so an op byte at or past the old kOpCount (only inputs the fuzzer made; the
// committed seeds write op values as they are) now decodes as a different op: still a valid
// script, just another one, which is all a fuzz corpus needs. Likewise a flag bit given a
// meaning later (kRequestPlaced) was ignored before.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpulazy::fuzz::server_script {

inline constexpr uint32_t kSlots = 4;

enum Op : uint8_t {
  kConnect = 0,     // slot, transport (kConnect*)
  kHello = 1,       // slot, min and max version, flags (kHello*), join source, name, and with
                    // kHelloJoin: a u64 id (kHelloRandomId), a secret string (no
                    // kHelloRightSecret); with kHelloToken a token string
  kOpenImage = 2,   // slot, image choice (kImageNames; the last one reads a string)
  kRequest = 3,     // slot, priority, flags (kRequest*), range count, ranges
  kCredit = 4,      // slot, kind (kCredit*), its operand
  kHave = 5,        // slot, range count, ranges
  kStats = 6,       // slot
  kGoodbye = 7,     // slot
  kJunk = 8,        // slot, length - 1 (kJunkLengthMask; kJunkBelowTls), that many bytes sent as
                    // they are
  kShutWrite = 9,   // slot: shutdown(SHUT_WR)
  kClose = 10,      // slot: close() with whatever is unread
  kDrain = 11,      // slot, wait in ms (0..3): read and check what has arrived
  kPrefix = 12,     // slot, header length u32, payload length u32: a frame prefix alone
  kSync = 13,       // slot: a stats request, then read until its answer (or the end)
  kPlaceInto = 14,  // slot, kind (kPlaceKind*), device (kPlaceDevice*), target count (mod
                    // kMaxPlaceTargets + 1), the kind's and the device's operands; then per
                    // target a BO byte (kPlaceBo*), a size byte (kPlaceSize*), a handle byte
                    // (kHandle*), then their operands in that order. The harness then reads
                    // the slot until the answer (docs/hostile-input.md)
  kOpCount = 15,
};

// kHello flags.
// kConnect's transport byte. The harness runs its server in one of two modes (fuzz_server.cc):
// plain, where TCP connections are plain TCP, or TLS (GPULAZY_FUZZ_TLS=1), where the TCP listener
// speaks TLS and a TCP connection does the TLS handshake first.
inline constexpr uint8_t kConnectTcp = 1;  // else the Unix socket
// TLS mode: a TCP connection that skips the handshake, so its bytes reach the TLS listener as
// plain text (ignored in plain mode, and on the Unix socket).
inline constexpr uint8_t kConnectNoHandshake = 2;

// kJunk's length byte: the low five bits are the length - 1. On a connection that did the TLS
// handshake, kJunkBelowTls sends the bytes raw onto the socket, under TLS (a corrupt record);
// without it junk goes as TLS application data, like every other frame of that connection.
inline constexpr uint8_t kJunkLengthMask = 0x1F;
inline constexpr uint8_t kJunkBelowTls = 0x80;

inline constexpr uint8_t kHelloJoin = 1;  // join the session of the join-source slot
inline constexpr uint8_t kHelloWantFiles = 2;
inline constexpr uint8_t kHelloChunkTable = 4;
inline constexpr uint8_t kHelloLane = 8;
inline constexpr uint8_t kHelloRightSecret = 16;  // else the secret operand's bytes
inline constexpr uint8_t kHelloRandomId = 32;     // a u64 operand instead of the slot's session
inline constexpr uint8_t kHelloToken = 64;        // a token (the server requires none)

// kRequest flags.
inline constexpr uint8_t kRequestStreamAll = 1;
inline constexpr uint8_t kRequestByReference = 2;
inline constexpr uint8_t kRequestPlaced = 4;  // Request.placed: into the PlaceInto destinations

// kCredit kinds.
inline constexpr uint8_t kCreditZero = 0;
inline constexpr uint8_t kCreditPages = 1;  // (u8 + 1) * 4096
inline constexpr uint8_t kCreditAny = 2;    // u64
inline constexpr uint8_t kCreditMax = 3;    // UINT64_MAX

// kPlaceInto: the kind (mod kPlaceKindCount). The server places into memfds only.
inline constexpr uint8_t kPlaceKindMemfd = 0;   // "memfd"
inline constexpr uint8_t kPlaceKindCuda = 1;    // "cuda"
inline constexpr uint8_t kPlaceKindString = 2;  // a string operand
inline constexpr uint8_t kPlaceKindEmpty = 3;   // ""
inline constexpr uint8_t kPlaceKindCount = 4;
// The device (mod kPlaceDeviceCount); host memory has none.
inline constexpr uint8_t kPlaceDeviceNone = 0;
inline constexpr uint8_t kPlaceDeviceUuid = 1;    // 16 operand bytes, as a GPU's UUID
inline constexpr uint8_t kPlaceDeviceString = 2;  // a string operand
inline constexpr uint8_t kPlaceDeviceCount = 3;
inline constexpr uint8_t kMaxPlaceTargets = 7;
// A target's BO byte: the low two bits choose, the other six are the choice's number.
inline constexpr uint8_t kPlaceBoValid = 0;    // number mod the image's BO count
inline constexpr uint8_t kPlaceBoPastEnd = 1;  // the BO count + number: out of range
inline constexpr uint8_t kPlaceBoRepeat = 2;   // the BO of the target before (0 for the first)
inline constexpr uint8_t kPlaceBoAny = 3;      // a u32 operand
// A target's size byte (mod 4), from the size of its BO (4096 for a BO out of range).
inline constexpr uint8_t kPlaceSizeBo = 0;
inline constexpr uint8_t kPlaceSizeShort = 1;   // one byte short
inline constexpr uint8_t kPlaceSizeLarger = 2;  // a page more
inline constexpr uint8_t kPlaceSizeAny = 3;     // a u64 operand
// A target's handle byte (mod kHandleCount). Memfds are the harness's, alive until the script
// ends; past kMaxScriptMemfds in a script the new-memfd choices reuse the last one.
inline constexpr uint8_t kHandleMemfd = 0;        // a new memfd of the BO's size
inline constexpr uint8_t kHandleShortMemfd = 1;   // a new memfd one byte shorter than the BO
inline constexpr uint8_t kHandleLargerMemfd = 2;  // a new memfd a page larger than the BO
inline constexpr uint8_t kHandleSealedMemfd = 3;  // a new memfd of the BO's size, F_SEAL_WRITE
inline constexpr uint8_t kHandleLastMemfd = 4;    // the script's last memfd (aliasing BOs)
inline constexpr uint8_t kHandlePipe = 5;         // the read end of a pipe: no memfd
inline constexpr uint8_t kHandleNumber = 6;       // a u32 operand as the descriptor number
inline constexpr uint8_t kHandleBytes = 7;        // a string operand as the handle, any length
inline constexpr uint8_t kHandleCount = 8;
inline constexpr uint32_t kMaxScriptMemfds = 32;

// What kOpenImage asks for, by index; the last reads a string operand instead.
inline constexpr const char* kImageNames[] = {"raw", "lazy",   "../raw", "/raw",
                                              "",    "raw/..", "missing"};
inline constexpr uint8_t kImageNameCount = 7;
inline constexpr uint8_t kImageString = kImageNameCount;  // index of the string choice

// A chunk-range number: bytes under 0xF0 are themselves (mod 32), others read a u32.
inline constexpr uint8_t kSmallLimit = 0xF0;
// A string's length byte: under this, the length mod 32; from it, 248 + (byte - kLongString).
inline constexpr uint8_t kLongString = 0xF0;

class ScriptWriter {
 public:
  ScriptWriter& Byte(uint8_t b) {
    bytes_.push_back(b);
    return *this;
  }
  ScriptWriter& U32(uint32_t v) {
    for (int i = 0; i < 4; ++i)
      Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  ScriptWriter& U64(uint64_t v) {
    for (int i = 0; i < 8; ++i)
      Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  // The length byte, then the bytes: under 32 bytes, or 248 to 263.
  ScriptWriter& String(const std::string& s) {
    Byte(static_cast<uint8_t>(s.size() < 32 ? s.size() : kLongString + (s.size() - 248)));
    for (char c : s)
      Byte(static_cast<uint8_t>(c));
    return *this;
  }
  ScriptWriter& Op(uint8_t op, uint8_t slot, uint8_t request_id = 1) {
    return Byte(op).Byte(slot).Byte(request_id);
  }
  ScriptWriter& Connect(uint8_t slot, bool tcp) {
    return Op(kConnect, slot).Byte(tcp ? kConnectTcp : 0);
  }
  // TLS mode: plain text to the TLS listener; plain mode: a TCP connection.
  ScriptWriter& ConnectWithoutHandshake(uint8_t slot) {
    return Op(kConnect, slot).Byte(kConnectTcp | kConnectNoHandshake);
  }
  // A plain stream-connection Hello offering versions 1..max_version.
  ScriptWriter& Hello(uint8_t slot, uint8_t max_version) {
    return Op(kHello, slot).Byte(1).Byte(max_version).Byte(0).Byte(0).String("seed");
  }
  // Joins the session opened on `source` with its secret; flags add kHelloLane and the like.
  ScriptWriter& Join(uint8_t slot, uint8_t source, uint8_t flags) {
    return Op(kHello, slot)
        .Byte(1)
        .Byte(2)
        .Byte(static_cast<uint8_t>(kHelloJoin | kHelloRightSecret | flags))
        .Byte(source)
        .String("seed");
  }
  ScriptWriter& Open(uint8_t slot, uint8_t image) { return Op(kOpenImage, slot).Byte(image); }
  ScriptWriter& Credit(uint8_t slot, uint8_t pages) {
    return Op(kCredit, slot).Byte(kCreditPages).Byte(pages);
  }
  ScriptWriter& StreamAll(uint8_t slot, bool by_reference) {
    return Op(kRequest, slot, 2)
        .Byte(0)
        .Byte(static_cast<uint8_t>(kRequestStreamAll | (by_reference ? kRequestByReference : 0)))
        .Byte(0);
  }
  ScriptWriter& Ask(uint8_t slot, uint8_t priority, uint8_t bo, uint8_t first, uint8_t count,
                    uint8_t flags = 0) {
    return Op(kRequest, slot, 3)
        .Byte(priority)
        .Byte(flags)
        .Byte(1)
        .Byte(bo)
        .Byte(first)
        .Byte(count);
  }
  ScriptWriter& StreamAllPlaced(uint8_t slot) {
    return Op(kRequest, slot, 2)
        .Byte(0)
        .Byte(static_cast<uint8_t>(kRequestStreamAll | kRequestPlaced))
        .Byte(0);
  }
  // kPlaceInto's choice bytes; the kind's and the device's operands (kPlaceKindString,
  // kPlaceDeviceUuid / kPlaceDeviceString), then `targets` Target() calls must follow.
  ScriptWriter& PlaceInto(uint8_t slot, uint8_t kind, uint8_t device, uint8_t targets) {
    return Op(kPlaceInto, slot).Byte(kind).Byte(device).Byte(targets);
  }
  // A target: BO choice and its number (kPlaceBoAny: a u32 operand follows; write it with U32),
  // size choice, handle choice. Operands of kPlaceSizeAny and kHandleNumber / kHandleBytes
  // follow in that order: the caller writes them.
  ScriptWriter& Target(uint8_t bo_choice, uint8_t bo_number, uint8_t size, uint8_t handle) {
    return Byte(static_cast<uint8_t>(bo_choice | (bo_number << 2))).Byte(size).Byte(handle);
  }
  // The common good target: BO `bo`, its size, a new memfd of that size.
  ScriptWriter& GoodTarget(uint8_t bo) {
    return Target(kPlaceBoValid, bo, kPlaceSizeBo, kHandleMemfd);
  }
  ScriptWriter& Drain(uint8_t slot, uint8_t ms) { return Op(kDrain, slot).Byte(ms); }
  ScriptWriter& Sync(uint8_t slot) { return Op(kSync, slot); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace gpulazy::fuzz::server_script
