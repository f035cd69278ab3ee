#include "sinew/data.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "sinew/base/error.h"
#include "sinew/base/mix.h"

namespace sinew {

namespace {

void checkBatch(const char* what, int64_t step, int64_t globalBatch, int64_t datasetSize) {
  if (datasetSize <= 0 || globalBatch < 0 || step < 0) {
    SINEW_THROW(InvalidArgument, what, ": datasetSize = ", datasetSize,
                " must be positive, globalBatch = ", globalBatch, " and step = ", step,
                " not negative");
  }
}

std::string systemError() { return std::strerror(errno); }

}  // namespace

int64_t epochOrder(uint64_t seed, int64_t epoch, int64_t position, int64_t datasetSize) {
  if (datasetSize <= 1) return 0;
  // A balanced Feistel network on 2h bits, 2^(2h) >= datasetSize, walked until it lands
  // inside [0, datasetSize): a permutation of [0, datasetSize).
  int bits = 0;
  while ((int64_t{1} << bits) < datasetSize) ++bits;
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  const uint64_t key = detail::splitmix64(seed ^ 0xE90C5ull) ^
                       detail::splitmix64(static_cast<uint64_t>(epoch) + 0x51ull);
  uint64_t x = static_cast<uint64_t>(position);
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = detail::splitmix64(key ^ (round << 56) ^ right) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<uint64_t>(datasetSize));
  return static_cast<int64_t>(x);
}

int64_t epochOfStep(int64_t step, int64_t globalBatch, int64_t datasetSize) {
  checkBatch("epochOfStep", step, globalBatch, datasetSize);
  return step * globalBatch / datasetSize;
}

std::vector<int64_t> epochBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                       int64_t datasetSize) {
  checkBatch("epochBatchIndices", step, globalBatch, datasetSize);
  std::vector<int64_t> out(static_cast<size_t>(globalBatch));
  const int64_t first = step * globalBatch;
  for (int64_t j = 0; j < globalBatch; ++j) {
    const int64_t p = first + j;
    out[j] = epochOrder(seed, p / datasetSize, p % datasetSize, datasetSize);
  }
  return out;
}

std::vector<int64_t> batchIndices(Sampling sampling, uint64_t seed, int64_t step,
                                  int64_t globalBatch, int64_t datasetSize) {
  if (sampling == Sampling::kEpochs) {
    return epochBatchIndices(seed, step, globalBatch, datasetSize);
  }
  checkBatch("batchIndices", step, globalBatch, datasetSize);
  return globalBatchIndices(seed, step, globalBatch, datasetSize);
}

struct TokenFile::Mapping {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (data != nullptr) ::munmap(const_cast<uint8_t*>(data), bytes);
  }
};

TokenFile::TokenFile(const std::string& path, int tokenBytes)
    : path_(path), tokenBytes_(tokenBytes) {
  if (tokenBytes != 2 && tokenBytes != 4) {
    SINEW_THROW(InvalidArgument, "token file '", path, "': token width ", tokenBytes,
                " bytes; it must be 2 (uint16) or 4 (uint32)");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) SINEW_THROW(IoError, "token file '", path, "' cannot be opened: ", systemError());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = systemError();
    ::close(fd);
    SINEW_THROW(IoError, "token file '", path, "' cannot be read: ", why);
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes == 0 || bytes % static_cast<size_t>(tokenBytes) != 0) {
    ::close(fd);
    SINEW_THROW(InvalidArgument, "token file '", path, "' has ", bytes,
                " bytes, which is not a positive multiple of its token width of ", tokenBytes,
                " bytes (a file of another width, or cut short?)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  const std::string why = p == MAP_FAILED ? systemError() : "";
  ::close(fd);
  if (p == MAP_FAILED) SINEW_THROW(IoError, "token file '", path, "' cannot be mapped: ", why);
  auto map = std::make_shared<Mapping>();
  map->data = static_cast<const uint8_t*>(p);
  map->bytes = bytes;
  map_ = std::move(map);
}

int64_t TokenFile::tokens() const { return static_cast<int64_t>(map_->bytes) / tokenBytes_; }

int64_t TokenFile::token(int64_t i) const {
  const uint8_t* b = map_->data + static_cast<size_t>(i) * static_cast<size_t>(tokenBytes_);
  uint32_t v = 0;
  for (int k = tokenBytes_ - 1; k >= 0; --k) v = (v << 8) | b[k];  // little-endian
  return v;
}

int64_t TokenFile::windows(int64_t window) const {
  if (window < 1) {
    SINEW_THROW(InvalidArgument, "token file '", path_, "': window = ", window,
                " must be at least 1 token");
  }
  return (tokens() - 1) / window;
}

Dataset TokenFile::dataset(int64_t window, int64_t first, int64_t count) const {
  const int64_t all = windows(window);
  if (count < 0) count = all - first;
  if (first < 0 || count <= 0 || first + count > all) {
    SINEW_THROW(InvalidArgument, "token file '", path_, "': windows [", first, ", ", first + count,
                ") of ", window, " tokens are not within its ", all, " windows (", tokens(),
                " tokens)");
  }
  TokenFile self = *this;  // shares the mapping
  return [self, window, first, count](int64_t i) {
    if (i < 0 || i >= count) {
      SINEW_THROW(InvalidArgument, "token file '", self.path_, "': sample ", i,
                  " is outside its dataset of ", count, " windows");
    }
    const int64_t begin = (first + i) * window;
    at::Tensor ids = at::empty({window + 1}, at::kLong);
    auto* out = ids.data_ptr<int64_t>();
    for (int64_t k = 0; k <= window; ++k) out[k] = self.token(begin + k);
    return Sample{ids.narrow(0, 0, window).clone(), ids.narrow(0, 1, window).clone()};
  };
}

void TokenFile::write(const std::string& path, const std::vector<int64_t>& tokens, int tokenBytes) {
  if (tokenBytes != 2 && tokenBytes != 4) {
    SINEW_THROW(InvalidArgument, "token file '", path, "': token width ", tokenBytes,
                " bytes; it must be 2 or 4");
  }
  const int64_t limit = tokenBytes == 2 ? 0xFFFF : 0xFFFFFFFFll;
  std::vector<uint8_t> bytes;
  bytes.reserve(tokens.size() * static_cast<size_t>(tokenBytes));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > limit) {
      SINEW_THROW(InvalidArgument, "token file '", path, "': token ", i, " = ", tokens[i],
                  " does not fit in ", tokenBytes, " bytes");
    }
    for (int k = 0; k < tokenBytes; ++k) {
      bytes.push_back(static_cast<uint8_t>(static_cast<uint64_t>(tokens[i]) >> (8 * k)));
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) SINEW_THROW(IoError, "token file '", tmp, "' cannot be written");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    SINEW_THROW(IoError, "token file '", path, "' cannot be renamed into place: ", systemError());
  }
}

}  // namespace sinew
