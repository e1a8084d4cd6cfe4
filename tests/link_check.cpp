// An empty program. tests/CMakeLists.txt links each library into it whole, with only the
// libraries below it, so a call from a lower layer into a higher one fails to link.
int main() { return 0; }
