// The one way gpulazy includes Boost.Asio (and its OpenSSL layer). Boost 1.74's awaitable.hpp uses
// std::exchange without including <utility>; including it first keeps every translation unit
// building.
#pragma once

// clang-format off
#include <utility>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
// clang-format on
