// The real KFD: ioctls on /dev/kfd. Compiled always; never run on this project's machines.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>

#include "plugin/kfd.h"

namespace gpulazy::plugin {
namespace {

constexpr const char* kKfdPath = "/dev/kfd";

class RealKfd : public Kfd {
 public:
  RealKfd(int fd, bool owned) : fd_(fd), owned_(owned) {}
  ~RealKfd() override {
    if (!owned_) (void)fd_.release();
  }
  int fd() const override { return fd_.get(); }
  int CriuOp(kfd_ioctl_criu_args& args) override {
    int rc;
    do {
      rc = ::ioctl(fd_.get(), AMDKFD_IOC_CRIU_OP, &args);
    } while (rc == -1 && (errno == EINTR || errno == EAGAIN));
    return rc == -1 ? -errno : 0;
  }

 private:
  UniqueFd fd_;
  bool owned_;
};

class RealKfdProvider : public KfdProvider {
 public:
  explicit RealKfdProvider(std::string dri_root) : dri_root_(std::move(dri_root)) {}
  std::string_view name() const override { return "kfd"; }
  Result<std::unique_ptr<Kfd>> Open() override {
    int fd = ::open(kKfdPath, O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "open {}", kKfdPath);
    return std::unique_ptr<Kfd>(std::make_unique<RealKfd>(fd, true));
  }
  Result<std::unique_ptr<Kfd>> Attach(int fd) override {
    return std::unique_ptr<Kfd>(std::make_unique<RealKfd>(fd, false));
  }
  bool IsKfd(int fd) const override {
    struct stat a {
    }, b{};
    if (::fstat(fd, &a) != 0 || ::stat(kKfdPath, &b) != 0) return false;
    return S_ISCHR(a.st_mode) && a.st_rdev == b.st_rdev;
  }
  bool IsKfdPath(const std::string& path) const override { return path == kKfdPath; }
  Result<UniqueFd> OpenRenderNode(uint32_t minor) override {
    std::string path = dri_root_ + "/renderD" + std::to_string(minor);
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "open {}", path);
    return UniqueFd(fd);
  }
  std::unique_ptr<DrmFile> AttachDrm(int render_fd) override { return MakeRealDrmFile(render_fd); }
  bool real() const override { return true; }

 private:
  std::string dri_root_;
};

}  // namespace

std::unique_ptr<KfdProvider> MakeRealKfdProvider(std::string dri_root) {
  return std::make_unique<RealKfdProvider>(std::move(dri_root));
}

std::string_view CriuOpName(uint32_t op) {
  switch (op) {
    case KFD_CRIU_OP_PROCESS_INFO:
      return "PROCESS_INFO";
    case KFD_CRIU_OP_CHECKPOINT:
      return "CHECKPOINT";
    case KFD_CRIU_OP_UNPAUSE:
      return "UNPAUSE";
    case KFD_CRIU_OP_RESTORE:
      return "RESTORE";
    case KFD_CRIU_OP_RESUME:
      return "RESUME";
    default:
      return "?";
  }
}

}  // namespace gpulazy::plugin
