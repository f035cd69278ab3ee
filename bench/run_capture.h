#pragma once

// What the job benches share: running a program to completion with its stdout and stderr in a
// file, and the text it printed.

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace sinew_bench {

// Runs argv (argv[0] a path) with stdout and stderr into `out` and waits for it; returns what
// it printed. Throws std::runtime_error naming argv[0] and `out` unless it exited with 0.
inline std::string runCapturing(std::vector<std::string> argv, const std::string& out) {
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    FILE* f = std::freopen(out.c_str(), "w", stdout);
    if (f == nullptr) _exit(127);
    dup2(fileno(stdout), STDERR_FILENO);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error(argv[0] + " failed; see " + out);
  }
  return text;
}

}  // namespace sinew_bench
