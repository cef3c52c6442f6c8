#include "plugin/criu_host.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

namespace gpulazy::plugin {

CriuHost CriuHost::Resolve() {
  CriuHost h;
  h.check_and_remove_inventory_plugin =
      reinterpret_cast<gpulazy_check_and_remove_inventory_plugin_t>(
          ::dlsym(RTLD_DEFAULT, "check_and_remove_inventory_plugin"));
  h.criu_get_image_dir =
      reinterpret_cast<gpulazy_criu_get_image_dir_t>(::dlsym(RTLD_DEFAULT, "criu_get_image_dir"));
  h.fdstore_add = reinterpret_cast<gpulazy_fdstore_add_t>(::dlsym(RTLD_DEFAULT, "fdstore_add"));
  h.fdstore_get = reinterpret_cast<gpulazy_fdstore_get_t>(::dlsym(RTLD_DEFAULT, "fdstore_get"));
  return h;
}

bool CriuHost::Claim(const std::string& name) const {
  if (check_and_remove_inventory_plugin == nullptr) return false;
  return check_and_remove_inventory_plugin(name.c_str(), name.size());
}

Result<std::filesystem::path> CriuHost::ImageDir() const {
  if (criu_get_image_dir != nullptr) {
    int fd = criu_get_image_dir();
    if (fd >= 0) {
      // The directory's path where it still names this very directory (the master: the
      // in-process server serves it by path). Inside a restored container's mount namespace
      // the path the kernel reports may name nothing, or another directory mounted there:
      // then the fd's own link, which always leads to it.
      std::error_code ec;
      std::filesystem::path link = "/proc/self/fd/" + std::to_string(fd);
      std::filesystem::path real = std::filesystem::read_symlink(link, ec);
      struct stat by_fd {};
      struct stat by_path {};
      if (!ec && ::fstat(fd, &by_fd) == 0 && ::stat(real.c_str(), &by_path) == 0 &&
          S_ISDIR(by_path.st_mode) && by_path.st_dev == by_fd.st_dev &&
          by_path.st_ino == by_fd.st_ino)
        return real;
      return link;
    }
  }
  if (const char* dir = std::getenv("GPULAZY_IMAGE_DIR")) return std::filesystem::path(dir);
  return NotFound(
      "no image directory: CRIU's criu_get_image_dir is missing and GPULAZY_IMAGE_DIR unset");
}

Status OursFailed(Status status) {
  if (status.code() != Code::kNotFound) return status;
  return Status(Code::kIoError, status.message());
}

}  // namespace gpulazy::plugin
