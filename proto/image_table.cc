#include "proto/image_table.h"

#include <algorithm>

namespace gpulazy {

wire::ImageTable MakeImageTable(const manifest::Manifest& manifest) {
  wire::ImageTable table;
  table.mutable_bos()->Reserve(manifest.bos_size());
  for (const manifest::Bo& bo : manifest.bos()) {
    wire::BoInfo* info = table.add_bos();
    info->set_process_id(bo.process_id());
    info->set_bo_index(bo.bo_index());
    info->set_gpu_id(bo.gpu_id());
    info->set_gpu_va(bo.gpu_va());
    info->set_size(bo.size());
    info->set_alloc_flags(bo.alloc_flags());
    info->set_chunk_count(static_cast<uint32_t>(bo.chunks_size()));
  }
  const manifest::AccessProfile& profile = manifest.profile();
  manifest::AccessProfile* hot = table.mutable_profile();
  hot->set_hot_count(profile.hot_count());
  hot->set_source(profile.source());
  const int keep = static_cast<int>(
      std::min<uint64_t>(profile.hot_count(), static_cast<uint64_t>(profile.order_size())));
  hot->mutable_order()->Reserve(keep);
  for (int i = 0; i < keep; ++i)
    *hot->add_order() = profile.order(i);
  return table;
}

Result<TableAssembler> TableAssembler::Begin(uint64_t announced, uint64_t limit) {
  if (announced > limit)
    return ResourceExhausted("image table of {} bytes announced, over the limit of {}", announced,
                             limit);
  TableAssembler assembler(announced);
  // Grown as bytes arrive, so an announcement alone does not allocate the whole limit.
  assembler.bytes_.reserve(std::min<uint64_t>(announced, 4u << 20));
  return assembler;
}

Status TableAssembler::Add(std::span<const uint8_t> piece, bool continuation) {
  if (piece.size() > missing())
    return Corrupt("image table piece of {} bytes with {} of {} announced bytes missing",
                   piece.size(), missing(), announced_);
  if (continuation && piece.empty())
    return Corrupt("empty image table part with {} of {} bytes missing", missing(), announced_);
  bytes_.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  return Status::Ok();
}

}  // namespace gpulazy
