// The public store factories (sinew/store.h) over the implementation classes.
#include "sinew/store.h"

#include "sinew/base/error.h"
#include "sinew/collectives/file_store.h"
#include "sinew/collectives/hash_store.h"
#include "sinew/collectives/prefix_store.h"
#include "sinew/collectives/tcp_store.h"

namespace sinew {
namespace collectives {

std::shared_ptr<Store> makeHashStore() { return std::make_shared<HashStore>(); }

std::shared_ptr<Store> makeFileStore(const std::string& dir) {
  return std::make_shared<FileStore>(dir);
}

std::shared_ptr<Store> makePrefixStore(const std::string& prefix, std::shared_ptr<Store> base) {
  return std::make_shared<PrefixStore>(prefix, std::move(base));
}

std::shared_ptr<Store> connectTcpStore(const std::string& host, uint16_t port,
                                       const TcpStoreOptions& options) {
  if (port == 0) SINEW_THROW(InvalidArgument, "connectTcpStore: port = 0 for host '", host, "'");
  return std::make_shared<TcpStore>(host, port, options);
}

}  // namespace collectives
}  // namespace sinew
