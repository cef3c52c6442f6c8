// The one way gpulazy includes Boost.Asio. Boost 1.74's awaitable.hpp uses std::exchange
// without including <utility>; including it first keeps every translation unit building.
#pragma once

#include <boost/asio.hpp>
#include <utility>
