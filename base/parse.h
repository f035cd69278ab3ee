#pragma once

// Strict conversions of untrusted text (environment variables, command-line flags, fault
// specs, file names) and JSON values (manifests, profiles, records from peers) to numbers.
// One place, so every input is held to the same rules:
//   - text: the whole string is the number (no blanks, no trailing junk, no "+", no hex),
//     integers in range without wrapping, doubles finite (no nan, no inf);
//   - JSON: integers only (never a float such as 1.5 or 1e3, a string or a bool), range-
//     checked before any conversion, so nothing is silently truncated.
// Failures throw InvalidArgument naming what was parsed and the offending value; callers
// that read stored or received bytes rethrow it as Corruption (jsonInt takes the error type).
// Internal: included by .cc files only; not installed.

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"

namespace sinew {
namespace detail {

// The integer that is exactly `text` (optional '-' then decimal digits), or nullopt.
inline std::optional<int64_t> tryParseInt(const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto r = std::from_chars(text.data(), end, v, 10);
  if (text.empty() || r.ec != std::errc() || r.ptr != end) return std::nullopt;
  return v;
}

// The unsigned 64-bit integer that is exactly `text` (decimal digits only), or nullopt.
inline std::optional<uint64_t> tryParseUint(const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto r = std::from_chars(text.data(), end, v, 10);
  if (text.empty() || r.ec != std::errc() || r.ptr != end) return std::nullopt;
  return v;
}

// The job token that is exactly `text`: hexadecimal digits (no "0x", no sign, no blanks) of a
// non-zero 64-bit value, as SINEW_TOKEN holds it; or nullopt. The one exception to "no hex".
inline std::optional<uint64_t> tryParseToken(const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto r = std::from_chars(text.data(), end, v, 16);
  if (text.empty() || r.ec != std::errc() || r.ptr != end || v == 0) return std::nullopt;
  return v;
}

// The job token that is exactly `text`; throws InvalidArgument "<what>='<text>' is not a
// non-zero hexadecimal job token" otherwise.
inline uint64_t parseToken(const std::string& text, const std::string& what) {
  auto v = tryParseToken(text);
  if (!v)
    SINEW_THROW(InvalidArgument, what, "='", text, "' is not a non-zero hexadecimal job token");
  return *v;
}

// The value of environment variable `name`, or null when it is unset or empty.
inline const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? v : nullptr;
}

// The finite double that is exactly `text` (decimal or scientific notation), or nullopt.
inline std::optional<double> tryParseFinite(const std::string& text) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto r = std::from_chars(text.data(), end, v, std::chars_format::general);
  if (text.empty() || r.ec != std::errc() || r.ptr != end || !std::isfinite(v)) {
    return std::nullopt;
  }
  return v;
}

// Parses a decimal integer in [min, max] into *out. Returns "" on success, else the message
//   "<what> needs an integer, got '<text>'" or "<what> must be in [min, max], got <text>".
// For callers that report errors themselves (command-line tools); others use parseInt.
inline std::string parseIntOrError(const std::string& text, const std::string& what, int64_t min,
                                   int64_t max, int64_t* out) {
  auto v = tryParseInt(text);
  if (!v) {
    // Digits that do not fit int64 are out of range rather than not a number.
    const bool digits =
        text.find_first_of("0123456789") != std::string::npos &&
        text.find_first_not_of("0123456789", text[0] == '-' ? 1 : 0) == std::string::npos;
    if (!digits) return what + " needs an integer, got '" + text + "'";
  }
  if (!v || *v < min || *v > max) {
    return what + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
           text;
  }
  *out = *v;
  return "";
}

// Parses a finite number in [min, max] into *out. Returns "" on success, else the message
//   "<what> needs a finite number, got '<text>'" or "<what> must be in [min, max], got <text>".
inline std::string parseFiniteOrError(const std::string& text, const std::string& what, double min,
                                      double max, double* out) {
  auto v = tryParseFinite(text);
  if (!v) return what + " needs a finite number, got '" + text + "'";
  if (!(*v >= min && *v <= max)) {
    std::ostringstream os;
    os << what << " must be in [" << min << ", " << max << "], got " << text;
    return os.str();
  }
  *out = *v;
  return "";
}

// parseIntOrError that throws InvalidArgument with the message.
inline int64_t parseInt(const std::string& text, const std::string& what, int64_t min,
                        int64_t max) {
  int64_t v = 0;
  const std::string error = parseIntOrError(text, what, min, max, &v);
  if (!error.empty()) SINEW_THROW(InvalidArgument, error);
  return v;
}

// parseFiniteOrError that throws InvalidArgument with the message.
inline double parseFinite(const std::string& text, const std::string& what, double min,
                          double max) {
  double v = 0;
  const std::string error = parseFiniteOrError(text, what, min, max, &v);
  if (!error.empty()) SINEW_THROW(InvalidArgument, error);
  return v;
}

// A short description of a JSON value for an error message, without formatting the whole of
// it (nlohmann's dump() recurses per level and is as long as the value): a scalar as JSON (a
// string cut to 40 characters), a container as "an array of N" or "an object of N fields".
inline std::string jsonPreview(const nlohmann::json& j) {
  if (j.is_array()) return "an array of " + std::to_string(j.size());
  if (j.is_object()) return "an object of " + std::to_string(j.size()) + " fields";
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    // Invalid UTF-8 (or a character cut at 40 bytes) is replaced, never thrown.
    const auto replace = nlohmann::json::error_handler_t::replace;
    return s.size() <= 40 ? nlohmann::json(s).dump(-1, ' ', false, replace)
                          : nlohmann::json(s.substr(0, 40)).dump(-1, ' ', false, replace) + "...";
  }
  return j.dump();
}

// The deepest nesting of arrays and objects Sinew reads in any JSON document from outside
// (coordinator and replica messages, manifests, control requests, profiles, plans, etcd
// values). Checked on the text before it is parsed: formatting or walking a value nested
// hundreds of thousands deep recurses that deep and crashes the process.
constexpr int kMaxJsonDepth = 64;

// Whether `text` nests arrays and objects deeper than `limit` (brackets inside strings do not
// count). One pass, no recursion; stops at the first level past the limit.
inline bool jsonTooDeep(const char* begin, const char* end, int limit = kMaxJsonDepth) {
  int depth = 0;
  bool inString = false;
  for (const char* p = begin; p < end; ++p) {
    const char c = *p;
    if (inString) {
      if (c == '\\') {
        ++p;
      } else if (c == '"') {
        inString = false;
      }
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}
inline bool jsonTooDeep(const std::string& text, int limit = kMaxJsonDepth) {
  return jsonTooDeep(text.data(), text.data() + text.size(), limit);
}

// json::parse of untrusted `text` that never throws: a discarded value (is_discarded()) when
// the text nests deeper than kMaxJsonDepth or is not JSON.
inline nlohmann::json tryParseJson(const std::string& text) {
  if (jsonTooDeep(text)) return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// json::parse of untrusted `text`, throwing E naming `what`: "<what> nests JSON deeper than 64
// levels" or "<what> does not parse: <the parser's reason>".
template <typename E = InvalidArgument>
nlohmann::json parseJson(const std::string& text, const std::string& what) {
  if (jsonTooDeep(text)) SINEW_THROW(E, what, " nests JSON deeper than ", kMaxJsonDepth, " levels");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    SINEW_THROW(E, what, " does not parse: ", e.what());
  }
}

// The JSON integer j in [min, max] (a signed or unsigned JSON integer; floats, strings,
// bools and null are rejected). Throws E (InvalidArgument, Corruption):
//   "<what> must be an integer in [min, max], got <j as JSON>".
template <typename E = InvalidArgument>
int64_t jsonInt(const nlohmann::json& j, const std::string& what, int64_t min, int64_t max) {
  bool ok = false;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    v = ok ? static_cast<int64_t>(u) : 0;
  } else if (j.is_number_integer()) {
    ok = true;
    v = j.get<int64_t>();
  }
  if (!ok || v < min || v > max) {
    SINEW_THROW(E, what, " must be an integer in [", min, ", ", max, "], got ", jsonPreview(j));
  }
  return v;
}

// The JSON string j. Throws E: "<what> must be a string, got <j as JSON>".
template <typename E = InvalidArgument>
std::string jsonString(const nlohmann::json& j, const std::string& what) {
  if (!j.is_string()) SINEW_THROW(E, what, " must be a string, got ", jsonPreview(j));
  return j.get<std::string>();
}

// The member `key` of the JSON object j. Throws E: "<what> has no field '<key>'" (or
// "<what> must be a JSON object" when j is not one).
template <typename E = InvalidArgument>
const nlohmann::json& jsonField(const nlohmann::json& j, const char* key, const std::string& what) {
  if (!j.is_object()) SINEW_THROW(E, what, " must be a JSON object, got ", jsonPreview(j));
  auto it = j.find(key);
  if (it == j.end()) SINEW_THROW(E, what, " has no field '", key, "'");
  return *it;
}

// a * b and a + b for sizes, or nullopt on overflow.
inline std::optional<uint64_t> checkedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<uint64_t> checkedAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace detail
}  // namespace sinew
