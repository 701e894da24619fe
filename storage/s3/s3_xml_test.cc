#include "storage/s3/s3_xml.h"

#include <gtest/gtest.h>

#include "storage/s3/s3_client.h"

namespace loom::storage {
namespace {

TEST(S3Xml, ReadsAListingPage) {
  auto page = ParseListObjects(R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>ckpt</Name><Prefix>jobs/</Prefix><KeyCount>2</KeyCount>
  <IsTruncated>true</IsTruncated><NextContinuationToken>abc=</NextContinuationToken>
  <Contents><Key>jobs/a/step-00000001/manifest.json</Key><Size>812</Size><ETag>"e1"</ETag></Contents>
  <Contents><Key>jobs/a/step-00000001/shard-00000-of-00001.safetensors</Key><Size>4096</Size></Contents>
</ListBucketResult>)");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "jobs/a/step-00000001/manifest.json");
  EXPECT_EQ(page->objects[0].size, 812u);
  EXPECT_EQ(page->objects[0].etag, "\"e1\"");
  EXPECT_EQ(page->objects[1].size, 4096u);
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_token, "abc=");
}

TEST(S3Xml, RefusesWhatIsNotAListing) {
  EXPECT_FALSE(ParseListObjects("<Error><Code>AccessDenied</Code></Error>").ok());
  EXPECT_FALSE(ParseListObjects("<ListBucketResult><Contents><Size>x</Size>").ok());
  EXPECT_FALSE(
      ParseListObjects("<ListBucketResult><Contents><Size>-1</Size></Contents></ListBucketResult>")
          .ok());
  // Truncated without a token would list the same page forever.
  EXPECT_FALSE(ParseListObjects("<ListBucketResult><IsTruncated>true</IsTruncated>"
                                "</ListBucketResult>")
                   .ok());
  // Entity expansion is where XML bombs live.
  auto bomb = ParseListObjects(R"(<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>
<ListBucketResult><Prefix>&lol2;</Prefix></ListBucketResult>)");
  ASSERT_FALSE(bomb.ok());
  EXPECT_NE(bomb.status().message().find("DTD"), std::string::npos) << bomb.status();
}

TEST(S3Xml, ReadsErrorsAndUploadIds) {
  S3Error e = ParseError(
      "<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Reduce your request rate."
      "</Message><RequestId>1</RequestId></Error>");
  EXPECT_EQ(e.code, "SlowDown");
  EXPECT_EQ(e.message, "Reduce your request rate.");
  EXPECT_EQ(ParseError("not xml").code, "");
  auto id = ParseUploadId(
      "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>u-1</UploadId>"
      "</InitiateMultipartUploadResult>");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, "u-1");
  EXPECT_FALSE(ParseUploadId("<InitiateMultipartUploadResult/>").ok());
}

TEST(S3Url, ParsesBucketAndPrefix) {
  auto a = ParseS3Url("s3://my-bucket/a//b/");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bucket, "my-bucket");
  EXPECT_EQ(a->prefix, "a/b");
  EXPECT_EQ(a->Url("step-00000001"), "s3://my-bucket/a/b/step-00000001");
  auto bare = ParseS3Url("s3://bucket");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->Key("x"), "x");
  EXPECT_FALSE(ParseS3Url("s3://B/x").ok());
  EXPECT_FALSE(ParseS3Url("s3://ab").ok());
  EXPECT_FALSE(ParseS3Url("s3://bucket/a/../b").ok());
  EXPECT_FALSE(ParseS3Url("/local/path").ok());
}

}  // namespace
}  // namespace loom::storage
