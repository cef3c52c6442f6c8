#include "tests/fuzz/fuzz_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <system_error>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"

namespace gpulazy::fuzz {
namespace {

class Scratch {
 public:
  Scratch() {
    // tmpfs where there is one: harnesses write files for every input, and conversion fsyncs.
    std::string pattern = std::filesystem::is_directory("/dev/shm") ? "/dev/shm/gl-fuzz-XXXXXX"
                                                                    : "/tmp/gl-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    path_ = pattern;
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace

const std::filesystem::path& ScratchDir() {
  static const Scratch scratch;
  return scratch.path();
}

void WriteFileOrDie(const std::filesystem::path& path, std::span<const uint8_t> bytes) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  Status status = fd.valid() ? WriteAllAt(fd.get(), 0, bytes, path)
                             : ErrnoError(errno, "create {}", path.string());
  if (!status.ok()) {
    std::fprintf(stderr, "fuzz: %s\n", status.ToString().c_str());
    std::abort();
  }
}

Status MakeTinyCheckpoint(const std::filesystem::path& dir, bool lazy) {
  image::SynthOptions options;
  options.out = dir;
  options.gpus = 1;
  options.bos = 6;
  options.total_bytes = 64 * 1024;
  options.seed = 1;
  GPULAZY_RETURN_IF_ERROR(image::SynthesizeCheckpoint(options).status());
  if (!lazy) return Status::Ok();
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  image::ConvertOptions convert;
  convert.chunk_size = kTinyChunkSize;
  return image::ConvertToLazyImage(checkpoint, convert).status();
}

}  // namespace gpulazy::fuzz
