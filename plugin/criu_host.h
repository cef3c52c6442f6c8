// CriuHost: the functions CRIU exports to plugins, resolved at run time with
// dlsym(RTLD_DEFAULT) so the shared object loads into any host (a test host, an older CRIU).
// Thread-safety: immutable after Resolve.
#pragma once

#include <filesystem>
#include <string>

#include "plugin/criu_abi.h"
#include "proto/status.h"

namespace gpulazy::plugin {

struct CriuHost {
  gpulazy_check_and_remove_inventory_plugin_t check_and_remove_inventory_plugin = nullptr;
  gpulazy_criu_get_image_dir_t criu_get_image_dir = nullptr;
  gpulazy_fdstore_add_t fdstore_add = nullptr;
  gpulazy_fdstore_get_t fdstore_get = nullptr;

  static CriuHost Resolve();
  // Claims a plugin entry of the inventory; true when it was listed (or there is no inventory).
  bool Claim(const std::string& name) const;
  // A path that opens CRIU's image directory as the calling process sees it: the directory's
  // own path where that still names it, else /proc/self/fd/<fd> (a restored task inside a
  // container's mount namespace, where the master's path names nothing or another directory);
  // $GPULAZY_IMAGE_DIR without CRIU. Ask again in each process: the answer differs.
  Result<std::filesystem::path> ImageDir() const;
};

// The hooks answer kNotFound with -ENOTSUP: "not ours, ask the next plugin". Once a hook knows
// the object is ours, a kNotFound from below (no /dev/kfd, no topology, a missing pages file)
// is our failure and must reach CRIU as one: kIoError with the same message.
Status OursFailed(Status status);

}  // namespace gpulazy::plugin
