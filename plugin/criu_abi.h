// Our own declaration of CRIU's plugin ABI (design.md 6). Debian 12 ships criu-plugin.h from
// CRIU 3.17 (10 hooks) and that CRIU does not run on this kernel, so the layout is written down
// here from the facts of CRIU 4.2 and criu-dev; the names are ours, the layout is CRIU's.
//
// Hook count. CRIU refuses a plugin whose max_hooks exceeds its own hook count (4.2: 13,
// criu-dev: 15) and then NULLs hooks[max_hooks .. its own count) in *our* descriptor. So:
//   - kDeclaredMaxHooks = 13 loads into 4.2 and criu-dev alike. Everything we need is below 13:
//     RESTORE_EXT_FILE=3, UPDATE_VMA_MAP=8, RESUME_DEVICES_LATE=9, POST_FORKING=12.
//   - RESTORE_INIT=13 and DUMP_DEVICES_LATE=14 are criu-dev only and would make 4.2 reject us.
//     We do not need them: init(RESTORE) does what RESTORE_INIT does, and the KFD dump is
//     complete inside DUMP_EXT_FILE. Their slots stay NULL.
//   - The hooks array is larger than any CRIU's count (kHookSlots) because CRIU writes NULLs
//     up to *its* count into it; a later CRIU with more hooks must not write past our object.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPULAZY_CRIU_PLUGIN_VERSION ((0u << 16) + (2u << 8) + 0u) /* 0.2.0 */

enum gpulazy_criu_stage {
  GPULAZY_CRIU_STAGE_DUMP = 0,
  GPULAZY_CRIU_STAGE_PRE_DUMP = 1,
  GPULAZY_CRIU_STAGE_RESTORE = 2,
};

enum gpulazy_criu_hook {
  GPULAZY_HOOK_DUMP_UNIX_SK = 0,
  GPULAZY_HOOK_RESTORE_UNIX_SK = 1,
  GPULAZY_HOOK_DUMP_EXT_FILE = 2,
  GPULAZY_HOOK_RESTORE_EXT_FILE = 3,
  GPULAZY_HOOK_DUMP_EXT_MOUNT = 4,
  GPULAZY_HOOK_RESTORE_EXT_MOUNT = 5,
  GPULAZY_HOOK_DUMP_EXT_LINK = 6,
  GPULAZY_HOOK_HANDLE_DEVICE_VMA = 7,
  GPULAZY_HOOK_UPDATE_VMA_MAP = 8,
  GPULAZY_HOOK_RESUME_DEVICES_LATE = 9,
  GPULAZY_HOOK_PAUSE_DEVICES = 10,
  GPULAZY_HOOK_CHECKPOINT_DEVICES = 11,
  GPULAZY_HOOK_POST_FORKING = 12,
  GPULAZY_HOOK_RESTORE_INIT = 13,      /* criu-dev only */
  GPULAZY_HOOK_DUMP_DEVICES_LATE = 14, /* criu-dev only */
  GPULAZY_HOOK_COUNT_CRIU_4_2 = 13,
  GPULAZY_HOOK_COUNT_CRIU_DEV = 15,
};

enum { GPULAZY_DECLARED_MAX_HOOKS = GPULAZY_HOOK_COUNT_CRIU_4_2, GPULAZY_HOOK_SLOTS = 32 };

/* Hook signatures, as CRIU calls them. */
typedef int (*gpulazy_dump_ext_file_t)(int fd, int id);
/* criu-dev passes a second argument; CRIU 4.2 passes only `id`. We declare the two-argument
 * form and never read or write `retry_needed`: under 4.2 the register holds garbage, and we
 * never need a retry (a KFD file depends on no other file). */
typedef int (*gpulazy_restore_ext_file_t)(int id, bool* retry_needed);
typedef int (*gpulazy_handle_device_vma_t)(int fd, const struct stat* st);
typedef int (*gpulazy_update_vma_map_t)(const char* path, uint64_t addr, uint64_t old_pgoff,
                                        uint64_t* new_pgoff, int* plugin_fd);
typedef int (*gpulazy_pid_hook_t)(int pid); /* RESUME_DEVICES_LATE, PAUSE/CHECKPOINT_DEVICES */
typedef int (*gpulazy_void_hook_t)(void);   /* POST_FORKING, RESTORE_INIT */

/* The layout of CRIU's cr_plugin_desc_t. */
struct gpulazy_criu_plugin_desc {
  const char* name;
  int (*init)(int stage);
  void (*exit)(int stage, int ret);
  unsigned int version;
  unsigned int max_hooks;
  void* hooks[GPULAZY_HOOK_SLOTS];
};

/* Functions CRIU exports to plugins; resolved with dlsym(RTLD_DEFAULT) (criu_host.h) so the
 * shared object also loads into a host that lacks them. */
typedef bool (*gpulazy_check_and_remove_inventory_plugin_t)(const char* name, size_t len);
typedef int (*gpulazy_criu_get_image_dir_t)(void);
typedef int (*gpulazy_fdstore_add_t)(int fd);
typedef int (*gpulazy_fdstore_get_t)(int id);

#ifdef __cplusplus
}
#endif
