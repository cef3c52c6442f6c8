// linux/kfd_ioctl.h includes <drm/drm.h>, which Debian ships only as libdrm's copy
// (/usr/include/libdrm/drm.h); this directory is on the plugin's include path to bridge that.
#pragma once
#include <libdrm/drm.h>
