#pragma once

// Files only this user may read (a job token's carriers: coordinator.json, srun's rendezvous
// file), written whole: a reader sees the old file or the new one, never a part, and never a
// moment in which the file is readable by others.
// Internal: included by .cc files only; not installed.

#include <string>

namespace sinew {
namespace detail {

// Makes `dir` and every missing folder above it, each mode 0700 (existing ones are left as
// they are). Throws IoError naming the folder that could not be made.
void makePrivateDirs(const std::string& dir);

// Writes `text` to `path`, mode 0600: under another name in the same folder, flushed to disk,
// then renamed over `path`. Throws IoError naming the path (the temporary file is removed).
void writePrivateFile(const std::string& path, const std::string& text);

}  // namespace detail
}  // namespace sinew
