#pragma once

// Test helpers for scratch folders and for running Sinew's command-line tools. Header-only,
// with no Sinew dependency, so any test can include it.

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "fs_support.h"

namespace sinew {
namespace testing {

// A new empty folder /tmp/sinew-<name>-XXXXXX.
inline std::string tempDir(const std::string& name) {
  std::string tmpl = "/tmp/sinew-" + name + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* d = ::mkdtemp(buf.data());
  if (d == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  return d;
}

// removeTree() comes from fs_support.h.

struct ToolRun {
  int status = -1;  // Exit status; -1 if it did not exit normally.
  std::string out;  // stdout and stderr
};

// Runs `tool args` through the shell and collects its output.
inline ToolRun runTool(const std::string& tool, const std::string& args) {
  std::string cmd = tool + " " + args + " 2>&1";
  ToolRun r;
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) r.out.append(buf, n);
  int st = ::pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace testing
}  // namespace sinew
