#include "bench/maps_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "lazy-server/image/io.h"
#include "page-client/uffd/mappings.h"
#include "page-client/uffd/userfaultfd.h"

namespace gpulazy::bench {
namespace {

// A PROT_NONE reservation of 2 x `pages` + 1 pages with every other page made read-write, from
// the second: one mapping per page, which the kernel cannot merge with its neighbours (its own
// PROT_NONE pages on both sides, so not with memory mapped next to the reservation either).
// Unmapped on destruction.
class ManyMappings {
 public:
  static Result<ManyMappings> Make(uint32_t pages) {
    ManyMappings made;
    made.length_ = (uint64_t{2} * pages + 1) * uffd::PageSize();
    void* at = ::mmap(nullptr, made.length_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) return ErrnoError(errno, "reserving {} bytes", made.length_);
    made.start_ = reinterpret_cast<uint64_t>(at);
    for (uint32_t i = 0; i < pages; ++i) {
      const uint64_t page = made.Page(i);
      if (::mprotect(reinterpret_cast<void*>(page), uffd::PageSize(), PROT_READ | PROT_WRITE) != 0)
        return ErrnoError(errno, "mprotect of page {} of {} (vm.max_map_count?)", i, pages);
    }
    made.pages_ = pages;
    return made;
  }
  ManyMappings() = default;
  ManyMappings(ManyMappings&& other) noexcept
      : start_(std::exchange(other.start_, 0)),
        length_(std::exchange(other.length_, 0)),
        pages_(other.pages_) {}
  ManyMappings& operator=(ManyMappings&&) = delete;
  ManyMappings(const ManyMappings&) = delete;
  ManyMappings& operator=(const ManyMappings&) = delete;
  ~ManyMappings() {
    if (start_ != 0) ::munmap(reinterpret_cast<void*>(start_), length_);
  }
  // The i-th read-write page.
  uint64_t Page(uint32_t i) const { return start_ + (uint64_t{2} * i + 1) * uffd::PageSize(); }
  uint32_t pages() const { return pages_; }

 private:
  uint64_t start_ = 0;
  uint64_t length_ = 0;
  uint32_t pages_ = 0;
};

}  // namespace

Status RunMapsBench(const CommonOptions& common, const MapsOptions& options) {
  if (options.mappings == 0 || options.lookups == 0)
    return InvalidArgument("--mappings and --lookups must be at least 1");
  GPULAZY_ASSIGN_OR_RETURN(ManyMappings many, ManyMappings::Make(options.mappings));
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uffd::MappingDetails> all, uffd::AllMappings(::getpid()));
  const std::string path = "/proc/" + std::to_string(::getpid()) + "/maps";
  std::mt19937 random(11);
  std::uniform_int_distribution<uint32_t> pick(0, many.pages() - 1);

  // The floor: opening and closing the maps file, as every lookup does.
  std::vector<double> floor;
  for (uint32_t i = 0; i < options.lookups; ++i) {
    const auto start = Clock::now();
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoError(errno, "open {}", path);
    fd = UniqueFd();
    floor.push_back(SecondsSince(start));
  }
  const double floor_p50 = Percentile(floor, 0.5);

  struct Kind {
    const char* name;
    uffd::MapsLookup lookup;
    uint32_t lookups;
  };
  const Kind kinds[] = {{"query", uffd::MapsLookup::kQuery, options.lookups},
                        {"text", uffd::MapsLookup::kText, std::max(1u, options.lookups / 10)}};
  for (const Kind& kind : kinds) {
    std::vector<double> samples;
    bool supported = true;
    for (uint32_t i = 0; i < kind.lookups; ++i) {
      const uint64_t page = many.Page(pick(random));
      const uint64_t address = page + 123;
      const auto start = Clock::now();
      Result<std::optional<uffd::MappingDetails>> found =
          uffd::MappingAt(::getpid(), address, kind.lookup);
      const double seconds = SecondsSince(start);
      if (found.status().code() == Code::kUnsupported) {
        supported = false;
        break;
      }
      if (!found.ok()) return found.status();
      // Every answer is checked: a lookup that found the wrong mapping measured nothing.
      if (!found->has_value() || (*found)->range.start != page ||
          (*found)->range.end != page + uffd::PageSize() || (*found)->shared)
        return Internal("{} lookup of {:#x} found {} instead of its one-page private mapping",
                        kind.name, address,
                        found->has_value()
                            ? fmt::format("[{:#x}, {:#x}){}", (*found)->range.start,
                                          (*found)->range.end, (*found)->shared ? " shared" : "")
                            : std::string("nothing"));
      samples.push_back(seconds);
    }
    const double p50 = Percentile(samples, 0.5);
    Emit(common,
         nlohmann::json{{"bench", "maps"},
                        {"lookup", kind.name},
                        {"supported", supported},
                        {"mappings", all.size()},
                        {"lookups", samples.size()},
                        {"p50_s", p50},
                        {"p99_s", Percentile(samples, 0.99)},
                        {"floor_s", floor_p50},
                        {"over_floor", supported && floor_p50 > 0 ? p50 / floor_p50 : 0.0},
                        {"machine", MachineDescription()}},
         {"bench", "lookup", "supported", "mappings", "p50_s", "p99_s", "floor_s", "over_floor"});
  }
  return Status::Ok();
}

}  // namespace gpulazy::bench
