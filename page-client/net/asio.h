// The one way gpulazy includes Boost.Asio. Boost 1.74's awaitable.hpp uses std::exchange
// without including <utility>; including it first keeps every translation unit building.
#pragma once

// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
