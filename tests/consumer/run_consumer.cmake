# Script mode: see tests/consumer/CMakeLists.txt.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${SINEW_BUILD_DIR} --prefix ${WORK_DIR}/staged)
file(RENAME ${WORK_DIR}/staged ${WORK_DIR}/moved)
foreach(f include/sinew/error.h include/sinew/init.h include/sinew/model.h
    include/sinew/trainer.h include/sinew/store.h include/sinew/communicator.h
    include/sinew/config.h bin/sinew-run)
  if(NOT EXISTS ${WORK_DIR}/moved/${f})
    message(FATAL_ERROR "installed package lacks ${f}")
  endif()
endforeach()

# Only the public API is installed (docs/api.md): include/sinew/ is flat, with no module
# folder, and every Sinew header an installed header includes is itself installed.
set(_inc ${WORK_DIR}/moved/include)
file(GLOB_RECURSE _entries LIST_DIRECTORIES true RELATIVE ${_inc} ${_inc}/sinew/*)
foreach(e ${_entries})
  if(IS_DIRECTORY ${_inc}/${e})
    message(FATAL_ERROR "installed headers contain the folder include/${e}: module folders "
      "(collectives/, checkpoint/, pipeline/, runtime/) are internal")
  endif()
endforeach()
file(GLOB_RECURSE _headers RELATIVE ${_inc} ${_inc}/*)
foreach(h ${_headers})
  file(STRINGS ${_inc}/${h} _lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]sinew/")
  foreach(line ${_lines})
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"](sinew/[^>\"]*)[>\"].*$" "\\1"
      _target "${line}")
    if(NOT EXISTS ${_inc}/${_target})
      message(FATAL_ERROR "installed include/${h} includes ${_target}, which is not installed "
        "(an internal header leaked into the public API)")
    endif()
  endforeach()
endforeach()
list(LENGTH _headers _count)
message(STATUS "${_count} installed headers include only installed headers")
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/moved -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "consumer ok: allreduce=3")
  message(FATAL_ERROR "consumer printed unexpected output: ${LAST_OUTPUT}")
endif()
message(STATUS "${LAST_OUTPUT}")
