// UTF-8 for protobuf `string` fields. proto3 refuses to parse a string field that is not valid
// UTF-8, so a frame whose text quotes untrusted bytes, or cuts text inside a character, is a
// corrupt frame to its reader: the peer would lose the message it was meant to get. Whatever
// text goes into a string field is made valid first (ToValidUtf8), and text cut to a length is
// cut at a character's edge (CutUtf8).
//
// Valid means RFC 3629: shortest forms only, no surrogates, nothing past U+10FFFF.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace gpulazy {

bool IsValidUtf8(std::string_view text);

// The longest prefix of `text` of at most `max_bytes` bytes that does not end inside a valid
// character (a byte that starts no valid character counts as one).
std::string_view CutUtf8(std::string_view text, size_t max_bytes);

// `text` with each byte that is not part of a valid character replaced by U+FFFD (valid text is
// returned as it came, moved).
std::string ToValidUtf8(std::string text);

}  // namespace gpulazy
