// The CRIU plugin's C ABI: the descriptor CR_PLUGIN_DESC and one thin extern "C" function per
// hook, each forwarding to PluginContext and mapping its Status to -errno. No exception crosses
// this boundary. kNotFound ("not ours") becomes -ENOTSUP so CRIU asks the next plugin.
#include <spdlog/spdlog.h>

#include <cerrno>
#include <exception>

#include "plugin/context.h"
#include "plugin/criu_abi.h"

using gpulazy::Code;
using gpulazy::Status;
using gpulazy::plugin::PluginContext;

namespace {

int ToErrno(const Status& s, const char* hook) {
  if (s.ok()) return 0;
  if (s.code() == Code::kNotFound) return -ENOTSUP;
  spdlog::error("gpulazy {}: {}", hook, s.ToString());
  return s.ToNegativeErrno();
}

template <typename F>
int Guard(const char* hook, F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return -ENOMEM;
  } catch (const std::exception& e) {
    spdlog::error("gpulazy {}: exception: {}", hook, e.what());
    return -EIO;
  } catch (...) {
    return -EIO;
  }
}

}  // namespace

extern "C" {

static int gpulazy_init(int stage) {
  return Guard("init", [&] { return ToErrno(PluginContext::Get().Init(stage), "init"); });
}

static void gpulazy_exit(int stage, int ret) {
  (void)Guard("exit", [&] {
    PluginContext::Get().Exit(stage, ret);
    return 0;
  });
}

static int gpulazy_dump_ext_file(int fd, int id) {
  return Guard("DUMP_EXT_FILE",
               [&] { return ToErrno(PluginContext::Get().DumpExtFile(fd, id), "DUMP_EXT_FILE"); });
}

static int gpulazy_restore_ext_file(int id, bool* /*retry_needed: see criu_abi.h*/) {
  return Guard("RESTORE_EXT_FILE", [&] {
    gpulazy::Result<int> fd = PluginContext::Get().RestoreExtFile(id);
    return fd.ok() ? *fd : ToErrno(fd.status(), "RESTORE_EXT_FILE");
  });
}

static int gpulazy_handle_device_vma(int fd, const struct stat* /*st*/) {
  return Guard("HANDLE_DEVICE_VMA", [&] {
    return ToErrno(PluginContext::Get().HandleDeviceVma(fd), "HANDLE_DEVICE_VMA");
  });
}

// CRIU applies *new_pgoff only when the hook answers 1 (files-reg.c), and dups *plugin_fd
// when it is >= 0.
static int gpulazy_update_vma_map(const char* path, uint64_t addr, uint64_t old_pgoff,
                                  uint64_t* new_pgoff, int* plugin_fd) {
  return Guard("UPDATE_VMA_MAP", [&] {
    gpulazy::Result<int> adjusted =
        PluginContext::Get().UpdateVmaMap(path, addr, old_pgoff, new_pgoff, plugin_fd);
    return adjusted.ok() ? *adjusted : ToErrno(adjusted.status(), "UPDATE_VMA_MAP");
  });
}

static int gpulazy_resume_devices_late(int pid) {
  return Guard("RESUME_DEVICES_LATE", [&] {
    return ToErrno(PluginContext::Get().ResumeDevicesLate(pid), "RESUME_DEVICES_LATE");
  });
}

static int gpulazy_post_forking(void) {
  return Guard("POST_FORKING", [&] {
    Status s = PluginContext::Get().PostForking();
    // Nothing of ours to do is success, not "ask someone else": POST_FORKING has no owner.
    return s.code() == Code::kNotFound ? 0 : ToErrno(s, "POST_FORKING");
  });
}

__attribute__((visibility("default"))) struct gpulazy_criu_plugin_desc CR_PLUGIN_DESC = {
    gpulazy::plugin::kPluginName,
    gpulazy_init,
    gpulazy_exit,
    GPULAZY_CRIU_PLUGIN_VERSION,
    GPULAZY_DECLARED_MAX_HOOKS,
    {
        nullptr,                                               // DUMP_UNIX_SK
        nullptr,                                               // RESTORE_UNIX_SK
        reinterpret_cast<void*>(gpulazy_dump_ext_file),        // DUMP_EXT_FILE
        reinterpret_cast<void*>(gpulazy_restore_ext_file),     // RESTORE_EXT_FILE
        nullptr,                                               // DUMP_EXT_MOUNT
        nullptr,                                               // RESTORE_EXT_MOUNT
        nullptr,                                               // DUMP_EXT_LINK
        reinterpret_cast<void*>(gpulazy_handle_device_vma),    // HANDLE_DEVICE_VMA
        reinterpret_cast<void*>(gpulazy_update_vma_map),       // UPDATE_VMA_MAP
        reinterpret_cast<void*>(gpulazy_resume_devices_late),  // RESUME_DEVICES_LATE
        nullptr,                                               // PAUSE_DEVICES
        nullptr,                                               // CHECKPOINT_DEVICES
        reinterpret_cast<void*>(gpulazy_post_forking),         // POST_FORKING
    },
};

}  // extern "C"
