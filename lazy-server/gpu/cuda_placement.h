// The "cuda" placement backend (server/placement.h): a DevicePlacer behind the server's
// PlacementBackend interface. Destinations are CUDA IPC handles of the client's device
// allocations; chunks go from the image's registered page cache to the device by DMA and are
// checked there before they are installed.
#pragma once

#include <memory>

#include "lazy-server/server/placement.h"

namespace gpulazy::server::gpu {

Result<std::unique_ptr<PlacementBackend>> CreateCudaPlacement(const PlacementOptions& options);

}  // namespace gpulazy::server::gpu
